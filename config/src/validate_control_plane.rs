//! Rules of the `discovery` and `events` sections.

use crate::control_security::{check_control_tls, check_etcd_auth, check_nats_auth};
use crate::discovery::valid_namespace;
use crate::validate_kv::check_kv;
use crate::violation::{Checked, fail, positive};
use crate::{Config, DiscoveryKind, EventsKind, FieldPath};

/// Checks `discovery` and `events`.
pub(crate) fn check_control_plane(config: &Config, root: &FieldPath) -> Checked {
    let path = root.key("discovery");
    let discovery = &config.discovery;
    if !valid_namespace(&discovery.namespace) {
        return fail(
            path.key("namespace"),
            format!(
                "invalid namespace {:?}: use letters, digits, '-' and '_'",
                discovery.namespace
            ),
        );
    }
    if discovery.kind == DiscoveryKind::Etcd
        && (discovery.endpoint.trim().is_empty()
            || discovery.endpoint.contains(char::is_whitespace))
    {
        return fail(
            path.key("endpoint"),
            format!(
                "invalid endpoint {:?}: expected http://host:port",
                discovery.endpoint
            ),
        );
    }
    check_etcd_security(config, &path)?;
    positive(
        discovery.initial_sync_timeout,
        path.key("initial_sync_timeout"),
    )?;
    let default_model = &discovery.default_model;
    if default_model
        .tokenizer
        .as_ref()
        .is_some_and(|dir| dir.as_os_str().is_empty())
    {
        return fail(
            path.key("default_model").key("tokenizer"),
            "must not be empty",
        );
    }
    check_kv(&default_model.kv, &path.key("default_model").key("kv"))?;
    check_events(config, &root.key("events"))
}

/// `discovery.tls` and `discovery.auth`, with `kind: etcd`: the endpoints' scheme must
/// match (`https://` with TLS, which needs the CA).
fn check_etcd_security(config: &Config, path: &FieldPath) -> Checked {
    let discovery = &config.discovery;
    if discovery.kind != DiscoveryKind::Etcd {
        return Ok(());
    }
    let endpoints = || {
        discovery
            .endpoint
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
    };
    let secure = endpoints().any(|url| url.starts_with("https://"));
    let plain = endpoints().any(|url| !url.starts_with("https://"));
    match &discovery.tls {
        Some(tls) => {
            check_control_tls(tls, &path.key("tls"))?;
            if tls.ca.is_none() {
                return fail(
                    path.key("tls").key("ca"),
                    "etcd TLS needs the CA that signs its members",
                );
            }
            if plain {
                return fail(path.key("endpoint"), "with tls, every endpoint is https://");
            }
        }
        None if secure => {
            return fail(
                path.key("tls"),
                "https:// endpoints need tls (at least its ca)",
            );
        }
        None => {}
    }
    if let Some(auth) = &discovery.auth {
        check_etcd_auth(auth, &path.key("auth"))?;
    }
    Ok(())
}

fn check_events(config: &Config, path: &FieldPath) -> Checked {
    let events = &config.events;
    if !valid_namespace(&events.namespace) {
        return fail(
            path.key("namespace"),
            format!(
                "invalid namespace {:?}: use letters, digits, '-' and '_'",
                events.namespace
            ),
        );
    }
    if events.kind == EventsKind::None {
        return Ok(());
    }
    if config.discovery.kind == DiscoveryKind::Static {
        return fail(
            path.key("kind"),
            format!(
                "events kind {} needs discovery kind etcd or in_process: events name \
                 instances by the id their agent registers",
                events.kind.as_str()
            ),
        );
    }
    if events.kind == EventsKind::Nats && events.url.trim().is_empty() {
        return fail(path.key("url"), "kind nats needs a server URL");
    }
    if events.kind == EventsKind::Nats {
        if let Some(tls) = &events.tls {
            check_control_tls(tls, &path.key("tls"))?;
        }
        check_nats_auth(&events.auth, &path.key("auth"))?;
        if let Some(jetstream) = &events.jetstream {
            let name = &jetstream.stream;
            if name.is_empty() || name.contains(|c: char| c.is_whitespace() || ".*>/\\".contains(c))
            {
                return fail(
                    path.key("jetstream").key("stream"),
                    format!("invalid stream name {name:?}: no spaces, '.', '*', '>', '/' or '\\'"),
                );
            }
            positive(jetstream.max_age, path.key("jetstream").key("max_age"))?;
        }
    }
    positive(events.resync_timeout, path.key("resync_timeout"))?;
    positive(events.ping_interval, path.key("ping_interval"))?;
    positive(events.load_report_ttl, path.key("load_report_ttl"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{Config, DiscoveryKind, EventsKind, PolicyKind};

    fn parse(yaml: &str) -> Result<Config, String> {
        Config::from_yaml_str(yaml, "c.yaml").map_err(|error| error.to_string())
    }

    const MODEL: &str = "models:\n  - name: m\n    backends: []\n";

    #[test]
    fn empty_backends_need_dynamic_discovery() {
        let error = parse(MODEL).unwrap_err();
        assert!(error.contains("models[0].backends"), "{error}");
        let config = parse(&format!(
            "{MODEL}discovery:\n  kind: etcd\n  endpoint: http://127.0.0.1:2379\n  \
             namespace: prod\n  default_model:\n    tokenizer: tok\n    kv:\n      \
             overlap_weight: 2.0\n"
        ))
        .unwrap();
        assert_eq!(config.discovery.kind, DiscoveryKind::Etcd);
        assert_eq!(config.discovery.namespace, "prod");
        assert!(config.discovery.default_model.enabled);
        assert_eq!(
            config.discovery.default_model.effective_policy(),
            PolicyKind::Kv
        );
        assert_eq!(config.discovery.default_model.kv.overlap_weight, 2.0);
        assert_eq!(config.events.kind, EventsKind::None);
    }

    #[test]
    fn events_need_dynamic_discovery_and_a_url() {
        let static_models =
            "models:\n  - name: m\n    backends:\n      - url: http://127.0.0.1:1\n";
        let error = parse(&format!("{static_models}events:\n  kind: nats\n")).unwrap_err();
        assert!(error.contains("events.kind"), "{error}");
        let dynamic = format!("{MODEL}discovery:\n  kind: in_process\n");
        let error = parse(&format!("{dynamic}events:\n  kind: nats\n  url: ''\n")).unwrap_err();
        assert!(error.contains("events.url"), "{error}");
        let config = parse(&format!("{dynamic}events:\n  kind: in_process\n")).unwrap();
        assert_eq!(config.events.kind, EventsKind::InProcess);
        assert_eq!(config.events.ping_interval, Duration::from_secs(2));
        let error = parse(&format!(
            "{dynamic}events:\n  kind: nats\n  ping_interval: 0s\n"
        ))
        .unwrap_err();
        assert!(error.contains("events.ping_interval"), "{error}");
        let config = parse(&format!(
            "{dynamic}events:\n  kind: nats\n  ping_interval: 500ms\n"
        ))
        .unwrap();
        assert_eq!(config.events.ping_interval, Duration::from_millis(500));
    }

    #[test]
    fn namespaces_backoffs_and_endpoints_are_checked() {
        let dynamic = format!("{MODEL}discovery:\n  kind: etcd\n");
        for (extra, field) in [
            ("  namespace: a.b\n", "discovery.namespace"),
            ("  endpoint: ''\n", "discovery.endpoint"),
            ("  endpoint: 'a b'\n", "discovery.endpoint"),
            (
                "  initial_sync_timeout: 0s\n",
                "discovery.initial_sync_timeout",
            ),
            (
                "  default_model:\n    kv:\n      block_size: 0\n",
                "block_size",
            ),
        ] {
            let error = parse(&format!("{dynamic}{extra}")).unwrap_err();
            assert!(error.contains(field), "{extra:?}: {error}");
        }
        let error = parse(&format!("{dynamic}events:\n  namespace: ''\n")).unwrap_err();
        assert!(error.contains("events.namespace"), "{error}");
    }

    #[test]
    fn control_plane_tls_and_credentials_are_checked() {
        let dir = std::env::temp_dir().join(format!("kvmesh-config-cp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let ca = write("ca.pem", "-----BEGIN CERTIFICATE-----\nx\n");
        let cert = write("c.pem", "-----BEGIN CERTIFICATE-----\nx\n");
        let key = write("k.pem", "-----BEGIN PRIVATE KEY-----\nx\n");
        let secret = write("secret", "s3cret\n");
        let empty = write("empty", "\n");
        let missing = dir.join("missing").display().to_string();
        let etcd = |extra: &str| {
            format!("{MODEL}discovery:\n  kind: etcd\n  endpoint: https://127.0.0.1:2379\n{extra}")
        };
        let good = etcd(&format!(
            "  tls:\n    ca: {ca}\n    cert: {cert}\n    key: {key}\n  auth:\n    user: kvmesh\n    password_file: {secret}\n\
             events:\n  kind: nats\n  url: tls://127.0.0.1:4222\n  tls:\n    ca: {ca}\n  auth:\n    nkey_seed_file: {secret}\n"
        ));
        let config = parse(&good).unwrap();
        assert_eq!(
            config
                .discovery
                .auth
                .as_ref()
                .map(|auth| auth.user.as_str()),
            Some("kvmesh")
        );
        assert!(config.events.auth.nkey_seed_file.is_some());
        for (yaml, field) in [
            (etcd(""), "discovery.tls"),
            (
                etcd(&format!("  tls:\n    cert: {cert}\n    key: {key}\n")),
                "discovery.tls.ca",
            ),
            (
                etcd(&format!("  tls:\n    ca: {missing}\n")),
                "discovery.tls.ca",
            ),
            (
                etcd(&format!("  tls:\n    ca: {ca}\n    cert: {cert}\n")),
                "discovery.tls.key",
            ),
            (
                etcd(&format!(
                    "  tls:\n    ca: {ca}\n  auth:\n    user: u\n    password_file: {empty}\n"
                )),
                "discovery.auth.password_file",
            ),
            (
                format!(
                    "{MODEL}discovery:\n  kind: etcd\n  endpoint: http://a:1,https://b:2\n  tls:\n    ca: {ca}\n"
                ),
                "discovery.endpoint",
            ),
        ] {
            let error = parse(&yaml).unwrap_err();
            assert!(error.contains(field), "{yaml}: {error}");
        }
        let nats = |auth: &str| {
            format!("{MODEL}discovery:\n  kind: in_process\nevents:\n  kind: nats\n  auth:\n{auth}")
        };
        for (auth, field) in [
            (
                format!("    token_file: {secret}\n    creds_file: {secret}\n"),
                "events.auth",
            ),
            ("    user: u\n".to_owned(), "events.auth.password_file"),
            (format!("    password_file: {secret}\n"), "events.auth.user"),
            (
                format!("    token_file: {missing}\n"),
                "events.auth.token_file",
            ),
        ] {
            let error = parse(&nats(&auth)).unwrap_err();
            assert!(error.contains(field), "{auth}: {error}");
        }
        assert!(
            parse(&nats(&format!(
                "    user: u\n    password_file: {secret}\n"
            )))
            .is_ok()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! Rules of the `discovery` and `events` sections.

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
    positive(events.resync_timeout, path.key("resync_timeout"))?;
    positive(events.load_report_ttl, path.key("load_report_ttl"))
}

#[cfg(test)]
mod tests {
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
}

//! Rules a parsed config must satisfy beyond its types.

use std::collections::HashMap;

use crate::auth::check_auth;
use crate::concurrency::check_concurrency;
use crate::disaggregation::{check_disaggregation, check_pools};
use crate::duration::format_duration;
use crate::engine_routes::check_engine_routes;
use crate::epp::check_epp;
use crate::grpc::check_grpc;
use crate::limits::{MAX_HEADER_BYTES, MAX_HEADERS};
use crate::reload::check_reload;
use crate::telemetry::check_telemetry;
use crate::tls::{check_listener_tls, check_upstream_tls};
use crate::validate_control_plane::check_control_plane;
use crate::validate_kv::check_kv;
use crate::violation::{Checked, fail, positive};
use crate::{Config, DiscoveryKind, FieldPath, ModelConfig, PolicyKind};

/// Checks every rule, in document order; returns the first violation.
pub(crate) fn validate(config: &Config) -> Checked {
    let root = FieldPath::root();
    check_listeners(config, &root)?;
    check_grpc(config, &root.key("grpc"))?;
    check_epp(config, &root.key("epp"))?;
    check_models(config, &root)?;
    check_engine_routes(&config.engine_routes, &root.key("engine_routes"))?;
    check_control_plane(config, &root)?;
    check_limits(config, &root.key("limits"))?;
    check_retry(config, &root.key("retry"))?;
    check_health_check(config, &root.key("health_check"))?;
    check_outlier_detection(config, &root.key("outlier_detection"))?;
    check_upstream(config, &root.key("upstream"))?;
    positive(
        config.shutdown.drain_timeout,
        root.key("shutdown").key("drain_timeout"),
    )?;
    check_auth(config, &root.key("auth"))?;
    check_reload(&config.reload, &root.key("reload"))?;
    check_telemetry(&config.telemetry, &root.key("telemetry"))
}

fn check_listeners(config: &Config, root: &FieldPath) -> Checked {
    let listeners = root.key("listeners");
    if config.listeners.is_empty() && config.epp.address.is_none() {
        return fail(
            listeners,
            "at least one listener is required (or epp.address, for an endpoint picker alone)",
        );
    }
    let mut names = HashMap::new();
    let mut addresses = HashMap::new();
    for (i, listener) in config.listeners.iter().enumerate() {
        let path = listeners.index(i);
        let name = &listener.name;
        if name.is_empty() {
            return fail(path.key("name"), "must not be empty");
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return fail(
                path.key("name"),
                format!("invalid name {name:?}: use letters, digits, '-' and '_'"),
            );
        }
        if name == "admin" {
            return fail(
                path.key("name"),
                "\"admin\" is reserved for the admin listener",
            );
        }
        if let Some(first) = names.insert(name.as_str(), i) {
            return fail(
                path.key("name"),
                format!("duplicate listener name {name:?} (also listeners[{first}])"),
            );
        }
        if let Some(tls) = &listener.tls {
            check_listener_tls(tls, &path.key("tls"))?;
        }
        if listener.address.port() != 0
            && let Some(first) = addresses.insert(listener.address, i)
        {
            return fail(
                path.key("address"),
                format!(
                    "address {} is already used by listeners[{first}]",
                    listener.address
                ),
            );
        }
    }
    let admin = config.admin.address;
    if admin.port() != 0
        && let Some(i) = addresses.get(&admin)
    {
        return fail(
            root.key("admin").key("address"),
            format!("address {admin} is already used by listeners[{i}]"),
        );
    }
    Ok(())
}

fn check_models(config: &Config, root: &FieldPath) -> Checked {
    let models = root.key("models");
    let discovered_serve =
        config.discovery.kind != DiscoveryKind::Static && config.discovery.default_model.enabled;
    if config.models.is_empty() && !discovered_serve {
        return fail(
            models,
            "at least one model is required (or discovery kind etcd / in_process with \
             default_model enabled, which serves the discovered models)",
        );
    }
    let mut names: HashMap<&str, FieldPath> = HashMap::new();
    for (i, model) in config.models.iter().enumerate() {
        let path = models.index(i);
        claim(&mut names, &model.name, path.key("name"))?;
        for (j, alias) in model.aliases.iter().enumerate() {
            claim(&mut names, alias, path.key("aliases").index(j))?;
        }
        let backends = path.key("backends");
        if model.backends.is_empty() && config.discovery.kind == DiscoveryKind::Static {
            return fail(
                backends,
                "at least one backend is required (or discovery kind etcd or in_process)",
            );
        }
        let mut urls = HashMap::new();
        for (j, backend) in model.backends.iter().enumerate() {
            if let Some(first) = urls.insert(backend.url.as_str(), j) {
                return fail(
                    backends.index(j).key("url"),
                    format!("duplicate backend {} (also backends[{first}])", backend.url),
                );
            }
        }
        check_model_routing(model, &path)?;
        check_disaggregation(model, &path)?;
        check_pools(model, &path)?;
        check_concurrency(&model.concurrency, &path.key("concurrency"))?;
    }
    check_adapters(config, &models, &names)
}

/// Adapter names are not empty, name no model or alias, and belong to one model only.
fn check_adapters(
    config: &Config,
    models: &FieldPath,
    names: &HashMap<&str, FieldPath>,
) -> Checked {
    let mut owners: HashMap<&str, usize> = HashMap::new();
    for (i, model) in config.models.iter().enumerate() {
        for (j, backend) in model.backends.iter().enumerate() {
            let path = models.index(i).key("backends").index(j).key("adapters");
            for (k, adapter) in backend.adapters.iter().enumerate() {
                let at = path.index(k);
                if adapter.trim().is_empty() {
                    return fail(at, "an adapter name must not be empty");
                }
                if let Some(model_name) = names.get(adapter.as_str()) {
                    return fail(
                        at,
                        format!("{adapter:?} is already a model name ({model_name})"),
                    );
                }
                if let Some(&owner) = owners.get(adapter.as_str())
                    && owner != i
                {
                    return fail(
                        at,
                        format!("adapter {adapter:?} is already served by models[{owner}]"),
                    );
                }
                owners.insert(adapter, i);
            }
        }
    }
    Ok(())
}

fn check_model_routing(model: &ModelConfig, path: &FieldPath) -> Checked {
    if model
        .tokenizer
        .as_ref()
        .is_some_and(|dir| dir.as_os_str().is_empty())
    {
        return fail(path.key("tokenizer"), "must not be empty");
    }
    if model.forward_token_ids {
        if model.policy != PolicyKind::Kv {
            return fail(
                path.key("forward_token_ids"),
                "needs policy: kv (only the kv policy tokenizes prompts)",
            );
        }
        if model.tokenizer.is_none() {
            return fail(
                path.key("forward_token_ids"),
                "needs a tokenizer directory (`tokenizer: DIR`)",
            );
        }
    }
    check_kv(&model.kv, &path.key("kv"))
}

/// Registers a model name or alias, rejecting empty, padded and duplicate names.
fn claim<'a>(names: &mut HashMap<&'a str, FieldPath>, name: &'a str, at: FieldPath) -> Checked {
    if name.is_empty() {
        return fail(at, "must not be empty");
    }
    if name.trim() != name {
        return fail(at, format!("{name:?} has leading or trailing whitespace"));
    }
    if let Some(first) = names.get(name) {
        return fail(
            at,
            format!("model name {name:?} is already used by {first}"),
        );
    }
    names.insert(name, at);
    Ok(())
}

fn check_limits(config: &Config, path: &FieldPath) -> Checked {
    let limits = &config.limits;
    if limits.max_body_bytes == 0 {
        return fail(path.key("max_body_bytes"), "must be greater than 0");
    }
    positive(limits.connect_timeout, path.key("connect_timeout"))?;
    positive(limits.first_byte_timeout, path.key("first_byte_timeout"))?;
    positive(limits.idle_timeout, path.key("idle_timeout"))?;
    positive(limits.write_timeout, path.key("write_timeout"))?;
    positive(
        limits.client_header_timeout,
        path.key("client_header_timeout"),
    )?;
    if !(1..=MAX_HEADER_BYTES).contains(&limits.max_header_bytes) {
        return fail(
            path.key("max_header_bytes"),
            format!("must be from 1 to {MAX_HEADER_BYTES}"),
        );
    }
    if !(1..=MAX_HEADERS).contains(&limits.max_headers) {
        return fail(
            path.key("max_headers"),
            format!("must be from 1 to {MAX_HEADERS}"),
        );
    }
    Ok(())
}

fn check_health_check(config: &Config, path: &FieldPath) -> Checked {
    let health = &config.health_check;
    if !health.path.starts_with('/') {
        return fail(
            path.key("path"),
            format!("{:?} must start with '/'", health.path),
        );
    }
    if health
        .path
        .contains(|c: char| c.is_whitespace() || c.is_control())
    {
        return fail(
            path.key("path"),
            format!("{:?} must not contain whitespace", health.path),
        );
    }
    positive(health.interval, path.key("interval"))?;
    positive(health.timeout, path.key("timeout"))?;
    if health.unhealthy_threshold == 0 {
        return fail(path.key("unhealthy_threshold"), "must be at least 1");
    }
    if health.healthy_threshold == 0 {
        return fail(path.key("healthy_threshold"), "must be at least 1");
    }
    Ok(())
}

fn check_retry(config: &Config, path: &FieldPath) -> Checked {
    let retry = &config.retry;
    for (i, &status) in retry.statuses.iter().enumerate() {
        if !(status == 429 || (500..=599).contains(&status)) {
            return fail(
                path.key("statuses").index(i),
                format!(
                    "{status} is not retryable: only 429 and 5xx are (other 4xx are the request's fault)"
                ),
            );
        }
    }
    positive(retry.backoff_base, path.key("backoff_base"))?;
    if retry.backoff_max < retry.backoff_base {
        return fail(
            path.key("backoff_max"),
            format!(
                "must be at least backoff_base ({})",
                format_duration(retry.backoff_base)
            ),
        );
    }
    if !(0.0..=10.0).contains(&retry.budget_ratio) {
        return fail(path.key("budget_ratio"), "must be between 0 and 10");
    }
    positive(retry.budget_window, path.key("budget_window"))?;
    if !(0.0..=1e6).contains(&retry.budget_min_per_second) {
        return fail(
            path.key("budget_min_per_second"),
            "must be between 0 and 1000000",
        );
    }
    Ok(())
}

fn check_outlier_detection(config: &Config, path: &FieldPath) -> Checked {
    let outlier = &config.outlier_detection;
    positive(outlier.base_ejection_time, path.key("base_ejection_time"))?;
    positive(outlier.max_ejection_time, path.key("max_ejection_time"))?;
    if outlier.max_ejection_time < outlier.base_ejection_time {
        return fail(
            path.key("max_ejection_time"),
            format!(
                "must be at least base_ejection_time ({})",
                format_duration(outlier.base_ejection_time)
            ),
        );
    }
    Ok(())
}

fn check_upstream(config: &Config, path: &FieldPath) -> Checked {
    if config.upstream.pool_size == 0 {
        return fail(path.key("pool_size"), "must be at least 1");
    }
    check_upstream_tls(&config.upstream.tls, &path.key("tls"))?;
    positive(
        config.upstream.pool_idle_timeout,
        path.key("pool_idle_timeout"),
    )
}

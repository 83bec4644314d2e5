//! Every validation rule, and where its error points.

use std::time::Duration;

use kvmesh_config::{
    BackendConfig, BackendUrl, Config, ConfigError, KvRoutingConfig, ModelConfig, PolicyKind,
    Protocol, Role, TextPosition,
};

const MINIMAL: &str = "\
models:
  - name: qwen3
    backends:
      - url: http://127.0.0.1:8001
";

fn err(text: &str) -> kvmesh_config::Invalid {
    match Config::from_yaml_str(text, "config.yaml") {
        Ok(config) => panic!("accepted: {config:?}"),
        Err(ConfigError::Invalid(invalid)) => invalid,
        Err(other) => panic!("unexpected error {other}"),
    }
}

/// Asserts the error names `field`, says `message` and points at `line`:`column`.
fn assert_err(text: &str, field: &str, message: &str, line: u64, column: u64) {
    let invalid = err(text);
    let rendered = invalid.to_string();
    assert_eq!(
        invalid.field.as_ref().map(ToString::to_string).as_deref(),
        Some(field),
        "{rendered}"
    );
    assert!(invalid.message.contains(message), "{rendered}");
    assert_eq!(
        invalid.position,
        Some(TextPosition { line, column }),
        "{rendered}"
    );
    assert!(
        rendered.starts_with(&format!("config.yaml:{line}:{column}: {field}: ")),
        "{rendered}"
    );
}

fn with_model(extra: &str) -> String {
    format!("{MINIMAL}{extra}")
}

#[test]
fn minimal_config_gets_every_default() {
    let config = Config::from_yaml_str(MINIMAL, "config.yaml").unwrap();
    let defaults = Config::default();
    assert_eq!(config.listeners, defaults.listeners);
    assert_eq!(config.listeners[0].name, "main");
    assert_eq!(config.listeners[0].address.to_string(), "127.0.0.1:8080");
    assert_eq!(config.admin.address.to_string(), "127.0.0.1:9090");
    assert_eq!(config.limits.max_body_bytes, 10 * 1024 * 1024);
    assert_eq!(config.limits.connect_timeout, Duration::from_secs(2));
    assert_eq!(config.limits.first_byte_timeout, Duration::from_secs(300));
    assert_eq!(config.limits.idle_timeout, Duration::from_secs(60));
    assert_eq!(config.limits.retries, 2);
    assert_eq!(config.limits.client_header_timeout, Duration::from_secs(30));
    assert!(config.health_check.enabled);
    assert_eq!(config.health_check.path, "/health");
    assert_eq!(config.health_check.interval, Duration::from_secs(5));
    assert_eq!(config.health_check.timeout, Duration::from_secs(1));
    assert_eq!(config.health_check.unhealthy_threshold, 2);
    assert_eq!(config.health_check.healthy_threshold, 1);
    assert_eq!(config.outlier_detection.consecutive_failures, 5);
    assert_eq!(
        config.outlier_detection.base_ejection_time,
        Duration::from_secs(5)
    );
    assert_eq!(
        config.outlier_detection.max_ejection_time,
        Duration::from_secs(120)
    );
    assert_eq!(config.upstream.pool_size, 128);
    assert_eq!(config.upstream.pool_idle_timeout, Duration::from_secs(90));
    assert_eq!(config.shutdown.drain_timeout, Duration::from_secs(30));
    let model = &config.models[0];
    assert_eq!(model.name, "qwen3");
    assert_eq!(model.policy, PolicyKind::RoundRobin);
    assert_eq!(model.backends[0].protocol, Protocol::Http1);
    assert_eq!(model.tokenizer, None);
    assert!(!model.forward_token_ids);
    let kv = &model.kv;
    assert_eq!(kv.block_size, None);
    assert_eq!(kv.block_size_or_fallback(), 16);
    assert_eq!(kv.overlap_weight, 1.0);
    assert_eq!((kv.tier_weights.host, kv.tier_weights.disk), (0.75, 0.25));
    assert_eq!(kv.temperature, 0.0);
    assert_eq!(kv.approx_ttl, Duration::from_secs(120));
    assert_eq!(kv.approx_max_blocks, 1_048_576);
    assert_eq!(kv.approx_prune_ratio, 0.8);
    assert_eq!(kv.total_kv_blocks, Some(16_384));
    assert_eq!(kv.busy_decode_blocks_fraction, Some(1.0));
    assert_eq!(kv.busy_prefill_tokens, Some(10_000_000));
    assert_eq!(kv.queue.max_size, 0);
    assert_eq!(kv.queue.timeout, Duration::from_secs(5));
    assert_eq!(kv.stale_request_timeout, Duration::from_secs(300));
    assert_eq!(kv.decider_timeout, Duration::from_millis(50));
    assert_eq!((kv.cache_check.window, kv.cache_check.mismatches), (8, 3));
}

#[test]
fn full_example_parses() {
    let text = "\
listeners:
  - name: main
    address: 127.0.0.1:0
  - name: second
    address: '[::1]:0'
admin:
  address: 127.0.0.1:0
models:
  - name: qwen3
    aliases: [qwen, q3]
    policy: power_of_two
    backends:
      - url: http://127.0.0.1:8001
        protocol: h2c
      - url: http://localhost:8002/
  - name: llama
    policy: least_request
    backends:
      - url: http://[::1]:8003
limits:
  max_body_bytes: 1024
  connect_timeout: 250ms
  first_byte_timeout: 2m
  idle_timeout: 1h
  retries: 0
  client_header_timeout: 5s
health_check:
  enabled: false
  path: /ready
  interval: 100ms
  timeout: 50ms
  unhealthy_threshold: 3
  healthy_threshold: 2
outlier_detection:
  consecutive_failures: 0
  base_ejection_time: 1s
  max_ejection_time: 1s
upstream:
  pool_size: 4
  pool_idle_timeout: 10s
shutdown:
  drain_timeout: 1s
";
    let config = Config::from_yaml_str(text, "full.yaml").unwrap();
    assert_eq!(config.listeners.len(), 2);
    assert_eq!(config.models[0].aliases, ["qwen", "q3"]);
    assert_eq!(config.models[0].policy, PolicyKind::PowerOfTwo);
    assert_eq!(config.models[0].backends[0].protocol, Protocol::H2c);
    assert_eq!(
        config.models[0].backends[1].url.as_str(),
        "http://localhost:8002"
    );
    assert_eq!(config.models[1].policy, PolicyKind::LeastRequest);
    assert_eq!(config.limits.connect_timeout, Duration::from_millis(250));
    assert_eq!(config.limits.first_byte_timeout, Duration::from_secs(120));
    assert_eq!(config.limits.idle_timeout, Duration::from_secs(3600));
    assert_eq!(config.limits.retries, 0);
    assert!(!config.health_check.enabled);
    assert_eq!(config.outlier_detection.consecutive_failures, 0);
    assert_eq!(config.upstream.pool_size, 4);
    assert_eq!(config.shutdown.drain_timeout, Duration::from_secs(1));
}

#[test]
fn invalid_backend_url_points_at_the_value() {
    let text = "\
models:
  - name: a
    backends:
      - url: http://127.0.0.1:1
      - url: x
";
    assert_err(
        text,
        "models[0].backends[1].url",
        "invalid URL \"x\"",
        5,
        14,
    );
}

#[test]
fn https_backend_needs_a_port() {
    let text = "models:\n  - name: a\n    backends:\n      - url: https://a\n";
    assert_err(text, "models[0].backends[0].url", "missing port", 4, 14);
}

#[test]
fn unknown_fields_are_errors() {
    let text = "\
models:
  - name: a
    backends:
      - url: http://127.0.0.1:1
        weight: 3
";
    assert_err(
        text,
        "models[0].backends[0].weight",
        "unknown field `weight`",
        5,
        9,
    );
    let top = err("model: x\n");
    assert!(
        top.to_string().starts_with(
            "config.yaml:1:1: model: unknown field `model`, expected one of listeners, admin, "
        ),
        "{top}"
    );
    for section in ["models", "limits", "upstream", "shutdown", "auth", "reload"] {
        assert!(top.message.contains(section), "{top}");
    }
    let nested = with_model("limits:\n  retry: 1\n");
    assert_err(&nested, "limits.retry", "unknown field `retry`", 6, 3);
}

#[test]
fn missing_backend_url_names_the_backend() {
    let text = "models:\n  - name: a\n    backends:\n      - protocol: h2c\n";
    assert_err(text, "models[0].backends[0]", "missing field `url`", 4, 9);
}

#[test]
fn unknown_enum_values_are_errors() {
    let policy = "models:\n  - name: a\n    policy: rr\n    backends:\n      - url: http://h:1\n";
    assert_err(policy, "models[0].policy", "unknown variant `rr`", 3, 13);
    let protocol =
        "models:\n  - name: a\n    backends:\n      - url: http://h:1\n        protocol: h3\n";
    assert_err(
        protocol,
        "models[0].backends[0].protocol",
        "unknown variant `h3`",
        5,
        19,
    );
}

#[test]
fn durations_need_a_unit_and_must_be_positive() {
    let no_unit = with_model("limits:\n  connect_timeout: 5\n");
    assert_err(&no_unit, "limits.connect_timeout", "missing unit", 6, 20);
    let bad_unit = with_model("health_check:\n  interval: 5d\n");
    assert_err(&bad_unit, "health_check.interval", "unknown unit", 6, 13);
    for (section, field) in [
        ("limits", "connect_timeout"),
        ("limits", "first_byte_timeout"),
        ("limits", "idle_timeout"),
        ("limits", "client_header_timeout"),
        ("health_check", "interval"),
        ("health_check", "timeout"),
        ("outlier_detection", "base_ejection_time"),
        ("outlier_detection", "max_ejection_time"),
        ("upstream", "pool_idle_timeout"),
        ("shutdown", "drain_timeout"),
    ] {
        let text = with_model(&format!("{section}:\n  {field}: 0ms\n"));
        assert_err(
            &text,
            &format!("{section}.{field}"),
            "must be greater than 0",
            6,
            field.len() as u64 + 5,
        );
    }
}

#[test]
fn numbers_must_have_the_right_type() {
    let negative = with_model("limits:\n  retries: -1\n");
    assert_err(&negative, "limits.retries", "invalid", 6, 12);
    let text = with_model("limits:\n  max_body_bytes: lots\n");
    assert_err(&text, "limits.max_body_bytes", "invalid", 6, 19);
}

#[test]
fn limits_and_thresholds_must_be_positive() {
    let body = with_model("limits:\n  max_body_bytes: 0\n");
    assert_err(&body, "limits.max_body_bytes", "greater than 0", 6, 19);
    let unhealthy = with_model("health_check:\n  unhealthy_threshold: 0\n");
    assert_err(
        &unhealthy,
        "health_check.unhealthy_threshold",
        "at least 1",
        6,
        24,
    );
    let healthy = with_model("health_check:\n  healthy_threshold: 0\n");
    assert_err(
        &healthy,
        "health_check.healthy_threshold",
        "at least 1",
        6,
        22,
    );
    let pool = with_model("upstream:\n  pool_size: 0\n");
    assert_err(&pool, "upstream.pool_size", "at least 1", 6, 14);
}

#[test]
fn health_check_path_must_be_absolute() {
    let text = with_model("health_check:\n  path: health\n");
    assert_err(&text, "health_check.path", "must start with '/'", 6, 9);
    let spaced = with_model("health_check:\n  path: /a b\n");
    assert_err(&spaced, "health_check.path", "whitespace", 6, 9);
}

#[test]
fn max_ejection_time_must_not_be_below_base() {
    let text =
        with_model("outlier_detection:\n  base_ejection_time: 10s\n  max_ejection_time: 5s\n");
    assert_err(
        &text,
        "outlier_detection.max_ejection_time",
        "at least base_ejection_time (10s)",
        7,
        22,
    );
}

#[test]
fn a_defaulted_field_points_at_its_section() {
    let text = with_model("outlier_detection:\n  base_ejection_time: 10m\n");
    // max_ejection_time (default 120s) is absent from the text: the error points
    // at the section that holds it.
    assert_err(
        &text,
        "outlier_detection.max_ejection_time",
        "at least base_ejection_time (10m)",
        6,
        3,
    );
}

#[test]
fn at_least_one_model_is_required() {
    let invalid = err("");
    assert_eq!(invalid.field.unwrap().to_string(), "models");
    assert!(invalid.message.contains("at least one model"));
    assert_err("models: []\n", "models", "at least one model", 1, 9);
    // The message says what else would do.
    assert_err(
        "models: []\n",
        "models",
        "(or discovery kind etcd / in_process with default_model enabled",
        1,
        9,
    );
    // Discovery without default_model serves no unlisted model: still refused.
    assert_err(
        "models: []\ndiscovery:\n  kind: etcd\n  default_model:\n    enabled: false\n",
        "models",
        "at least one model",
        1,
        9,
    );
}

#[test]
fn no_model_is_needed_when_discovery_serves_the_discovered_ones() {
    for kind in ["etcd", "in_process"] {
        for models in ["models: []\n", ""] {
            let text = format!("{models}discovery:\n  kind: {kind}\n");
            let config = Config::from_yaml_str(&text, "config.yaml")
                .unwrap_or_else(|error| panic!("{text:?}: {error}"));
            assert!(config.models.is_empty());
            assert!(config.discovery.default_model.enabled);
        }
    }
    let mut config = Config::default();
    config.discovery.kind = kvmesh_config::DiscoveryKind::InProcess;
    config.validate().unwrap();
    config.discovery.default_model.enabled = false;
    let error = config.validate().unwrap_err();
    assert!(
        error.to_string().contains("models: at least one model"),
        "{error}"
    );
}

#[test]
fn kv_block_size_is_unset_by_default_and_null_means_unset() {
    let kv = |body: &str| {
        let text = format!("{KV_MODEL}    kv:\n{body}");
        Config::from_yaml_str(&text, "kv.yaml")
            .unwrap_or_else(|error| panic!("{body:?}: {error}"))
            .models[0]
            .kv
            .clone()
    };
    assert_eq!(KvRoutingConfig::default().block_size, None);
    assert_eq!(kv("      overlap_weight: 1\n").block_size, None);
    assert_eq!(kv("      block_size: null\n").block_size, None);
    assert_eq!(kv("      block_size: ~\n").block_size, None);
    let fixed = kv("      block_size: 32\n");
    assert_eq!(fixed.block_size, Some(32));
    assert_eq!(fixed.block_size_or_fallback(), 32);
    assert_eq!(kv("      block_size: null\n").block_size_or_fallback(), 16);
    assert_eq!(kvmesh_config::FALLBACK_BLOCK_SIZE, 16);
    let discovered = Config::from_yaml_str(
        &format!(
            "{MINIMAL}discovery:\n  kind: etcd\n  default_model:\n    kv:\n      block_size: 32\n"
        ),
        "kv.yaml",
    )
    .unwrap();
    assert_eq!(discovered.discovery.default_model.kv.block_size, Some(32));
}

#[test]
fn at_least_one_listener_is_required() {
    let text = format!("listeners: []\n{MINIMAL}");
    assert_err(&text, "listeners", "at least one listener", 1, 12);
}

#[test]
fn listener_names_are_checked() {
    let listeners = |a: &str, b: &str| {
        format!(
            "listeners:\n  - name: {a}\n    address: 127.0.0.1:0\n  - name: {b}\n    address: 127.0.0.1:0\n{MINIMAL}"
        )
    };
    assert_err(
        &listeners("main", "main"),
        "listeners[1].name",
        "duplicate listener name \"main\"",
        4,
        11,
    );
    assert_err(
        &listeners("main", "admin"),
        "listeners[1].name",
        "reserved",
        4,
        11,
    );
    assert_err(
        &listeners("main", "'a b'"),
        "listeners[1].name",
        "invalid name",
        4,
        11,
    );
    assert_err(
        &listeners("''", "b"),
        "listeners[0].name",
        "must not be empty",
        2,
        11,
    );
}

#[test]
fn listener_addresses_are_checked() {
    let bad = format!("listeners:\n  - name: main\n    address: localhost\n{MINIMAL}");
    assert_err(
        &bad,
        "listeners[0].address",
        "invalid socket address",
        3,
        14,
    );
    let same = format!(
        "listeners:\n  - name: a\n    address: 127.0.0.1:7000\n  - name: b\n    address: 127.0.0.1:7000\n{MINIMAL}"
    );
    assert_err(&same, "listeners[1].address", "already used", 5, 14);
    let admin = format!(
        "listeners:\n  - name: a\n    address: 127.0.0.1:7000\nadmin:\n  address: 127.0.0.1:7000\n{MINIMAL}"
    );
    assert_err(
        &admin,
        "admin.address",
        "already used by listeners[0]",
        5,
        12,
    );
    let zero_ports = format!(
        "listeners:\n  - name: a\n    address: 127.0.0.1:0\n  - name: b\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n{MINIMAL}"
    );
    Config::from_yaml_str(&zero_ports, "config.yaml").unwrap();
}

#[test]
fn model_names_and_aliases_are_unique_across_models() {
    let text = "\
models:
  - name: a
    aliases: [b]
    backends:
      - url: http://h:1
  - name: c
    aliases: [d, b]
    backends:
      - url: http://h:2
";
    assert_err(
        text,
        "models[1].aliases[1]",
        "\"b\" is already used by models[0].aliases[0]",
        7,
        18,
    );
    let same_name = "\
models:
  - name: a
    backends:
      - url: http://h:1
  - name: a
    backends:
      - url: http://h:2
";
    assert_err(
        same_name,
        "models[1].name",
        "already used by models[0].name",
        5,
        11,
    );
    let alias_is_own_name =
        "models:\n  - name: a\n    aliases: [a]\n    backends:\n      - url: http://h:1\n";
    assert_err(
        alias_is_own_name,
        "models[0].aliases[0]",
        "already used",
        3,
        15,
    );
}

#[test]
fn model_names_must_be_non_empty_and_unpadded() {
    let empty = "models:\n  - name: ''\n    backends:\n      - url: http://h:1\n";
    assert_err(empty, "models[0].name", "must not be empty", 2, 11);
    let missing = "models:\n  - backends:\n      - url: http://h:1\n";
    let invalid = err(missing);
    assert_eq!(invalid.field.unwrap().to_string(), "models[0].name");
    let padded = "models:\n  - name: ' a'\n    backends:\n      - url: http://h:1\n";
    assert_err(padded, "models[0].name", "whitespace", 2, 11);
}

#[test]
fn every_model_needs_a_distinct_backend() {
    let none = "models:\n  - name: a\n    backends: []\n";
    assert_err(none, "models[0].backends", "at least one backend", 3, 15);
    let twice = "\
models:
  - name: a
    backends:
      - url: http://h:1
      - url: http://h:1/
";
    assert_err(
        twice,
        "models[0].backends[1].url",
        "duplicate backend http://h:1",
        5,
        14,
    );
}

#[test]
fn retry_settings_are_checked() {
    let ok = with_model("retry:\n  statuses: [503, 429]\n  budget_ratio: 0.5\n");
    let config = Config::from_yaml_str(&ok, "config.yaml").expect("valid");
    assert_eq!(config.retry.statuses, [503, 429]);
    assert_eq!(config.retry.budget_ratio, 0.5);
    assert!(config.retry.on_first_byte_timeout, "a default");
    let not_retryable = err(&with_model("retry:\n  statuses: [503, 404]\n"));
    assert_eq!(
        not_retryable.field.unwrap().to_string(),
        "retry.statuses[1]"
    );
    assert!(
        not_retryable.message.contains("only 429 and 5xx"),
        "{}",
        not_retryable.message
    );
    let backoff = err(&with_model(
        "retry:\n  backoff_base: 1s\n  backoff_max: 10ms\n",
    ));
    assert_eq!(backoff.field.unwrap().to_string(), "retry.backoff_max");
    let ratio = err(&with_model("retry:\n  budget_ratio: -1\n"));
    assert_eq!(ratio.field.unwrap().to_string(), "retry.budget_ratio");
}

#[test]
fn adapter_names_are_checked() {
    let ok = "\
models:
  - name: a
    backends:
      - url: http://h:1
        adapters: [sql-lora, chat-lora]
      - url: http://h:2
        adapters: [sql-lora]
";
    let config = Config::from_yaml_str(ok, "config.yaml").expect("valid");
    assert_eq!(
        config.models[0].backends[0].adapters,
        ["sql-lora", "chat-lora"]
    );
    assert_eq!(config.models[0].backends[1].adapters, ["sql-lora"]);
    let empty =
        "models:\n  - name: a\n    backends:\n      - url: http://h:1\n        adapters: ['']\n";
    assert_err(
        empty,
        "models[0].backends[0].adapters[0]",
        "must not be empty",
        5,
        20,
    );
    let model_name = "\
models:
  - name: a
    backends:
      - url: http://h:1
  - name: b
    aliases: [bee]
    backends:
      - url: http://h:2
        adapters: [a, bee]
";
    let invalid = err(model_name);
    assert_eq!(
        invalid.field.unwrap().to_string(),
        "models[1].backends[0].adapters[0]"
    );
    assert!(
        invalid.message.contains("already a model name"),
        "{}",
        invalid.message
    );
    let two_models = "\
models:
  - name: a
    backends:
      - url: http://h:1
        adapters: [x]
  - name: b
    backends:
      - url: http://h:2
        adapters: [x]
";
    let invalid = err(two_models);
    assert_eq!(
        invalid.field.unwrap().to_string(),
        "models[1].backends[0].adapters[0]"
    );
    assert!(
        invalid.message.contains("already served by models[0]"),
        "{}",
        invalid.message
    );
}

#[test]
fn syntax_errors_have_a_position() {
    let invalid = err("models: [\n");
    assert!(invalid.position.is_some(), "{invalid}");
    let duplicate = err("models:\n  - name: a\n    name: b\n");
    assert!(duplicate.message.contains("duplicate"), "{duplicate}");
    assert_eq!(duplicate.position.map(|p| p.line), Some(3));
}

#[test]
fn load_reads_a_file_and_names_it_in_errors() {
    let dir = std::env::temp_dir().join(format!("kvmesh-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.yaml");
    std::fs::write(&good, MINIMAL).unwrap();
    assert_eq!(Config::load(&good).unwrap().models[0].name, "qwen3");

    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "models:\n  - name: a\n    backends:\n      - url: x\n",
    )
    .unwrap();
    let message = Config::load(&bad).unwrap_err().to_string();
    assert!(
        message.starts_with(&format!(
            "{}:4:14: models[0].backends[0].url: invalid URL",
            bad.display()
        )),
        "{message}"
    );

    let missing = dir.join("missing.yaml");
    let error = Config::load(&missing).unwrap_err();
    assert!(matches!(error, ConfigError::Read { .. }), "{error}");
    assert!(error.invalid().is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn configs_built_in_code_are_validated_without_positions() {
    let mut config = Config::default();
    assert!(config.validate().is_err());
    config.models.push(ModelConfig {
        name: "m".into(),
        backends: vec![BackendConfig {
            url: BackendUrl::parse("http://127.0.0.1:1").unwrap(),
            protocol: Protocol::Http1,
            adapters: Vec::new(),
            role: Role::Both,
            pool: None,
            bootstrap_port: None,
        }],
        ..ModelConfig::default()
    });
    config.validate().unwrap();
    config.limits.retries = 7;
    config.limits.idle_timeout = Duration::ZERO;
    let error = config.validate().unwrap_err();
    assert_eq!(
        error.to_string(),
        "config: limits.idle_timeout: must be greater than 0"
    );
}

#[test]
fn the_example_file_spells_out_the_defaults() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/kvmesh.yaml");
    let example = Config::load(path).unwrap();
    let defaults = Config::default();
    assert_eq!(example.listeners, defaults.listeners);
    assert_eq!(example.admin, defaults.admin);
    assert_eq!(example.grpc, defaults.grpc);
    assert_eq!(example.limits, defaults.limits);
    assert_eq!(example.health_check, defaults.health_check);
    assert_eq!(example.outlier_detection, defaults.outlier_detection);
    assert_eq!(example.upstream, defaults.upstream);
    assert_eq!(example.shutdown, defaults.shutdown);
    assert_eq!(example.auth, defaults.auth);
    assert_eq!(example.reload, defaults.reload);
    assert_eq!(example.discovery, defaults.discovery);
    assert_eq!(example.events, defaults.events);
    let model = &example.models[0];
    assert_eq!(model.policy, PolicyKind::default());
    assert_eq!(model.backends[0].protocol, Protocol::default());
    let default_model = ModelConfig::default();
    assert_eq!(model.tokenizer, default_model.tokenizer);
    assert_eq!(model.forward_token_ids, default_model.forward_token_ids);
    assert_eq!(model.kv, KvRoutingConfig::default());
    assert_eq!(model.concurrency, default_model.concurrency);
}

const KV_MODEL: &str = "\
models:
  - name: qwen3
    policy: kv
    tokenizer: .cache/tokenizers/qwen3
    backends:
      - url: http://127.0.0.1:8001
";

#[test]
fn kv_policy_settings_parse() {
    let text = format!(
        "{KV_MODEL}    forward_token_ids: true
    kv:
      block_size: 16
      overlap_weight: 2
      temperature: 0.5
      approx_ttl: 30s
      approx_max_blocks: 1000
      approx_prune_ratio: 0.5
      total_kv_blocks: null
      busy_decode_blocks_fraction: ~
      busy_prefill_tokens: 0
      queue:
        max_size: 8
        timeout: 250ms
      stale_request_timeout: 1m
      decider_timeout: 0s
"
    );
    let config = Config::from_yaml_str(&text, "kv.yaml").unwrap();
    let model = &config.models[0];
    assert_eq!(model.policy, PolicyKind::Kv);
    assert_eq!(
        model.tokenizer.as_deref(),
        Some(std::path::Path::new(".cache/tokenizers/qwen3"))
    );
    assert!(model.forward_token_ids);
    let kv = &model.kv;
    assert_eq!(kv.block_size, Some(16));
    assert_eq!(kv.overlap_weight, 2.0);
    assert_eq!(kv.temperature, 0.5);
    assert_eq!(kv.approx_ttl, Duration::from_secs(30));
    assert_eq!(kv.approx_max_blocks, 1000);
    assert_eq!(kv.approx_prune_ratio, 0.5);
    assert_eq!(kv.total_kv_blocks, None);
    assert_eq!(kv.busy_decode_blocks_fraction, None);
    assert_eq!(kv.busy_decode_blocks(), None);
    assert_eq!(kv.busy_prefill_tokens_limit(), None);
    assert_eq!(kv.queue.max_size, 8);
    assert_eq!(kv.queue.timeout, Duration::from_millis(250));
    assert_eq!(kv.stale_request_timeout, Duration::from_secs(60));
    assert_eq!(kv.decider_timeout, Duration::ZERO);
}

#[test]
fn kv_policy_settings_are_validated() {
    let kv = |body: &str| format!("{KV_MODEL}    kv:\n{body}");
    assert_err(
        &kv("      block_size: 0\n"),
        "models[0].kv.block_size",
        "at least 1",
        8,
        19,
    );
    assert_err(
        &kv("      overlap_weight: -1\n"),
        "models[0].kv.overlap_weight",
        "finite number >= 0",
        8,
        23,
    );
    assert_err(
        &kv("      tier_weights:\n        host: 1.5\n"),
        "models[0].kv.tier_weights.host",
        "not in [0, 1]",
        9,
        15,
    );
    assert_err(
        &kv("      tier_weights:\n        disk: -0.1\n"),
        "models[0].kv.tier_weights.disk",
        "not in [0, 1]",
        9,
        15,
    );
    assert_err(
        &kv("      temperature: -0.1\n"),
        "models[0].kv.temperature",
        "finite number >= 0",
        8,
        20,
    );
    assert_err(
        &kv("      approx_ttl: 0s\n"),
        "models[0].kv.approx_ttl",
        "greater than 0",
        8,
        19,
    );
    assert_err(
        &kv("      approx_ttl: 9000h\n"),
        "models[0].kv.approx_ttl",
        "at most 8760h",
        8,
        19,
    );
    assert_err(
        &kv("      approx_max_blocks: 0\n"),
        "models[0].kv.approx_max_blocks",
        "at least 1",
        8,
        26,
    );
    for mismatches in ["0", "9"] {
        assert_err(
            &kv(&format!(
                "      cache_check:\n        mismatches: {mismatches}\n"
            )),
            "models[0].kv.cache_check.mismatches",
            "the window",
            9,
            21,
        );
    }
    let off = Config::from_yaml_str(
        &kv("      cache_check:\n        window: 0\n        mismatches: 0\n"),
        "kv.yaml",
    );
    assert_eq!(off.unwrap().models[0].kv.cache_check.window, 0);
    for ratio in ["0", "1.5"] {
        assert_err(
            &kv(&format!("      approx_prune_ratio: {ratio}\n")),
            "models[0].kv.approx_prune_ratio",
            "not in (0, 1]",
            8,
            27,
        );
    }
    assert_err(
        &kv("      busy_decode_blocks_fraction: -0.5\n"),
        "models[0].kv.busy_decode_blocks_fraction",
        "finite number >= 0",
        8,
        36,
    );
    assert_err(
        &kv("      queue:\n        timeout: 0ms\n"),
        "models[0].kv.queue.timeout",
        "greater than 0",
        9,
        18,
    );
    assert_err(
        &kv("      stale_request_timeout: 0s\n"),
        "models[0].kv.stale_request_timeout",
        "greater than 0",
        8,
        30,
    );
    assert_err(
        &kv("      decider_timeout: 2s\n"),
        "models[0].kv.decider_timeout",
        "at most 1s",
        8,
        24,
    );
    assert_err(
        &kv("      block_sizes: 4\n"),
        "models[0].kv.block_sizes",
        "unknown field `block_sizes`",
        8,
        7,
    );
    assert_err(
        &kv("      total_kv_blocks: -3\n"),
        "models[0].kv.total_kv_blocks",
        "invalid",
        8,
        24,
    );
}

#[test]
fn forward_token_ids_needs_the_kv_policy_and_a_tokenizer() {
    let no_tokenizer = "\
models:
  - name: a
    policy: kv
    forward_token_ids: true
    backends:
      - url: http://h:1
";
    assert_err(
        no_tokenizer,
        "models[0].forward_token_ids",
        "needs a tokenizer",
        4,
        24,
    );
    let other_policy = "\
models:
  - name: a
    tokenizer: tok
    forward_token_ids: true
    backends:
      - url: http://h:1
";
    assert_err(
        other_policy,
        "models[0].forward_token_ids",
        "needs policy: kv",
        4,
        24,
    );
    let empty = "models:\n  - name: a\n    tokenizer: ''\n    backends:\n      - url: http://h:1\n";
    assert_err(empty, "models[0].tokenizer", "must not be empty", 3, 16);
    let valid = "models:\n  - name: a\n    policy: kv\n    backends:\n      - url: http://h:1\n";
    let config = Config::from_yaml_str(valid, "config.yaml").unwrap();
    assert_eq!(config.models[0].tokenizer, None);
}

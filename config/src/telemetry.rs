//! Tracing: OpenTelemetry spans exported over OTLP/gRPC, off unless an endpoint is given.

use std::time::Duration;

use serde::Deserialize;

use crate::FieldPath;
use crate::violation::{Checked, fail, positive};

/// Largest `max_queue_size` accepted.
const MAX_QUEUE_SIZE: usize = 1 << 20;

/// `telemetry`: a span per proxied request, with a child per phase, sent to an OTLP/gRPC
/// receiver (an OpenTelemetry Collector, Jaeger, Tempo...). W3C `traceparent` and
/// `tracestate` are read from clients and written to engines while it is on; while it is off
/// (the default) no span is made and client headers pass through unchanged. Changes only on
/// restart.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The OTLP/gRPC receiver, `http://HOST:PORT` (plaintext; 4317 is OTLP's port);
    /// `null` (the default): tracing off.
    pub otlp_endpoint: Option<String>,
    /// Share of new traces recorded, 0 to 1. A request whose `traceparent` says sampled (or
    /// not) is recorded (or not) whatever the ratio.
    pub sampling_ratio: f64,
    /// `service.name` of the spans.
    pub service_name: String,
    /// Longest a finished span waits before it is exported.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub export_interval: Duration,
    /// Longest one export may take; its spans are dropped (and counted) after it.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub export_timeout: Duration,
    /// Finished spans waiting for export at most; more are dropped (and counted).
    pub max_queue_size: usize,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            sampling_ratio: 1.0,
            service_name: "kvmesh-proxy".to_string(),
            export_interval: Duration::from_secs(1),
            export_timeout: Duration::from_secs(10),
            max_queue_size: 2048,
        }
    }
}

/// Checks `telemetry`; `path` points at it.
pub(crate) fn check_telemetry(telemetry: &TelemetryConfig, path: &FieldPath) -> Checked {
    if let Some(endpoint) = &telemetry.otlp_endpoint {
        check_endpoint(endpoint).or_else(|why| fail(path.key("otlp_endpoint"), why))?;
    }
    if !(0.0..=1.0).contains(&telemetry.sampling_ratio) {
        return fail(
            path.key("sampling_ratio"),
            format!("{} must be from 0 to 1", telemetry.sampling_ratio),
        );
    }
    if telemetry.service_name.trim().is_empty() {
        return fail(path.key("service_name"), "must not be empty");
    }
    positive(telemetry.export_interval, path.key("export_interval"))?;
    positive(telemetry.export_timeout, path.key("export_timeout"))?;
    if !(1..=MAX_QUEUE_SIZE).contains(&telemetry.max_queue_size) {
        return fail(
            path.key("max_queue_size"),
            format!("must be from 1 to {MAX_QUEUE_SIZE}"),
        );
    }
    Ok(())
}

/// `http://HOST:PORT` with an optional trailing `/`.
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let invalid = |why: &str| Err(format!("invalid OTLP endpoint {endpoint:?}: {why}"));
    let Some(authority) = endpoint.strip_prefix("http://") else {
        return invalid("expected http://HOST:PORT (plaintext OTLP/gRPC)");
    };
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    let Some((host, port)) = authority.rsplit_once(':') else {
        return invalid("the port is missing (OTLP/gRPC listens on 4317)");
    };
    if host.is_empty() || host.contains(['/', '?', '#', '@', ' ']) {
        return invalid("expected http://HOST:PORT");
    }
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok(()),
        _ => invalid("the port must be a number from 1 to 65535"),
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    use super::*;

    const MODELS: &str =
        "models:\n  - name: m\n    backends:\n      - url: http://127.0.0.1:8000\n";

    fn parse(extra: &str) -> Result<Config, crate::ConfigError> {
        Config::from_yaml_str(&format!("{MODELS}{extra}"), "test.yaml")
    }

    #[test]
    fn off_by_default() {
        let config = parse("").unwrap();
        assert_eq!(config.telemetry, TelemetryConfig::default());
        assert_eq!(config.telemetry.otlp_endpoint, None);
    }

    #[test]
    fn parses_every_field() {
        let config = parse(
            "telemetry:\n  otlp_endpoint: http://collector:4317\n  sampling_ratio: 0.25\n  \
             service_name: edge\n  export_interval: 250ms\n  export_timeout: 2s\n  \
             max_queue_size: 100\n",
        )
        .unwrap();
        assert_eq!(
            config.telemetry,
            TelemetryConfig {
                otlp_endpoint: Some("http://collector:4317".into()),
                sampling_ratio: 0.25,
                service_name: "edge".into(),
                export_interval: Duration::from_millis(250),
                export_timeout: Duration::from_secs(2),
                max_queue_size: 100,
            }
        );
    }

    #[test]
    fn rejects_bad_values_with_their_line() {
        let cases = [
            ("otlp_endpoint: collector:4317", "otlp_endpoint", "http://"),
            ("otlp_endpoint: https://c:4317", "otlp_endpoint", "http://"),
            (
                "otlp_endpoint: http://c",
                "otlp_endpoint",
                "port is missing",
            ),
            ("otlp_endpoint: http://c:0", "otlp_endpoint", "port"),
            ("otlp_endpoint: http://:4317", "otlp_endpoint", "HOST"),
            ("otlp_endpoint: http://c:4317/v1", "otlp_endpoint", "port"),
            ("sampling_ratio: 1.5", "sampling_ratio", "from 0 to 1"),
            ("sampling_ratio: -0.1", "sampling_ratio", "from 0 to 1"),
            ("service_name: ' '", "service_name", "empty"),
            ("export_interval: 0s", "export_interval", "greater than 0"),
            ("export_timeout: 0s", "export_timeout", "greater than 0"),
            ("max_queue_size: 0", "max_queue_size", "from 1"),
        ];
        for (line, field, message) in cases {
            let error = parse(&format!("telemetry:\n  {line}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                error.starts_with("test.yaml:6:")
                    && error.contains(&format!("telemetry.{field}"))
                    && error.contains(message),
                "{line}: {error}"
            );
        }
        let error = parse("telemetry:\n  endpoint: x\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown field `endpoint`"), "{error}");
    }

    #[test]
    fn accepts_hosts_names_and_addresses() {
        for endpoint in [
            "http://127.0.0.1:4317",
            "http://otel-collector.monitoring:4317/",
            "http://[::1]:4317",
        ] {
            assert_eq!(check_endpoint(endpoint), Ok(()), "{endpoint}");
        }
    }
}

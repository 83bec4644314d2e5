//! The KServe v2 gRPC listener: off unless an address is given.

use std::net::SocketAddr;

use serde::Deserialize;

use crate::violation::{Checked, fail};
use crate::{Config, FieldPath};

/// Name the gRPC listener is announced under (`LISTENING grpc <addr>`).
pub const GRPC_LISTENER: &str = "grpc";

/// Largest `max_message_bytes` accepted (1 GiB).
pub const MAX_GRPC_MESSAGE_BYTES: usize = 1 << 30;

/// The gRPC listener (KServe v2 / Open Inference Protocol, `GRPCInferenceService`, with
/// `grpc.health.v1` and server reflection). It serves the same models, routing, limits
/// and metrics as the data listeners, over plaintext HTTP/2 (h2c).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcConfig {
    /// Address to bind; port 0 picks a free port; `null` (the default): no gRPC listener.
    pub address: Option<SocketAddr>,
    /// Largest message accepted from or sent to a client, in bytes (a larger one fails
    /// its call with OUT_OF_RANGE), and largest engine answer relayed.
    pub max_message_bytes: usize,
    /// Requests one `ModelStreamInfer` stream may have in flight at once; further
    /// requests on that stream wait until one finishes.
    pub max_stream_requests: usize,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            address: None,
            max_message_bytes: 4 * 1024 * 1024,
            max_stream_requests: 64,
        }
    }
}

/// Checks `grpc`; `path` points at it.
pub(crate) fn check_grpc(config: &Config, path: &FieldPath) -> Checked {
    let grpc = &config.grpc;
    if !(1..=MAX_GRPC_MESSAGE_BYTES).contains(&grpc.max_message_bytes) {
        return fail(
            path.key("max_message_bytes"),
            format!("must be from 1 to {MAX_GRPC_MESSAGE_BYTES}"),
        );
    }
    if grpc.max_stream_requests == 0 {
        return fail(path.key("max_stream_requests"), "must be at least 1");
    }
    let Some(address) = grpc.address else {
        return Ok(());
    };
    for (i, listener) in config.listeners.iter().enumerate() {
        if listener.name == GRPC_LISTENER {
            return fail(
                FieldPath::root().key("listeners").index(i).key("name"),
                format!(
                    "{GRPC_LISTENER:?} is reserved for the gRPC listener (grpc.address is set)"
                ),
            );
        }
        if address.port() != 0 && listener.address == address {
            return fail(
                path.key("address"),
                format!("address {address} is already used by listeners[{i}]"),
            );
        }
    }
    if address.port() != 0 && config.admin.address == address {
        return fail(
            path.key("address"),
            format!("address {address} is already used by admin.address"),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODELS: &str =
        "models:\n  - name: m\n    backends:\n      - url: http://127.0.0.1:8000\n";

    fn parse(extra: &str) -> Result<Config, crate::ConfigError> {
        Config::from_yaml_str(&format!("{MODELS}{extra}"), "test.yaml")
    }

    #[test]
    fn off_by_default() {
        let config = parse("").unwrap();
        assert_eq!(config.grpc, GrpcConfig::default());
        assert_eq!(config.grpc.address, None);
    }

    #[test]
    fn parses_every_field() {
        let config = parse(
            "grpc:\n  address: 127.0.0.1:8787\n  max_message_bytes: 1024\n  max_stream_requests: 8\n",
        )
        .unwrap();
        assert_eq!(
            config.grpc,
            GrpcConfig {
                address: Some("127.0.0.1:8787".parse().unwrap()),
                max_message_bytes: 1024,
                max_stream_requests: 8,
            }
        );
    }

    #[test]
    fn rejects_bad_values_with_their_line() {
        let error = parse("grpc:\n  address: 127.0.0.1:0\n  max_message_bytes: 0\n")
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("test.yaml:7:") && error.contains("grpc.max_message_bytes"),
            "{error}"
        );
        let error = parse("grpc:\n  max_stream_requests: 0\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("grpc.max_stream_requests"), "{error}");
        let error = parse("grpc:\n  port: 1\n").unwrap_err().to_string();
        assert!(error.contains("unknown field `port`"), "{error}");
    }

    #[test]
    fn the_address_must_be_its_own() {
        let listener = "listeners:\n  - name: main\n    address: 127.0.0.1:8080\n";
        let error = parse(&format!("{listener}grpc:\n  address: 127.0.0.1:8080\n"))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("grpc.address") && error.contains("listeners[0]"),
            "{error}"
        );
        let error = parse("admin:\n  address: 127.0.0.1:9999\ngrpc:\n  address: 127.0.0.1:9999\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("admin.address"), "{error}");
        let both_free = "listeners:\n  - name: main\n    address: 127.0.0.1:0\n\
                         admin:\n  address: 127.0.0.1:0\ngrpc:\n  address: 127.0.0.1:0\n";
        assert!(parse(both_free).is_ok());
    }

    #[test]
    fn the_name_grpc_is_reserved_while_the_listener_is_on() {
        let named = "listeners:\n  - name: grpc\n    address: 127.0.0.1:8080\n";
        assert!(parse(named).is_ok());
        let error = parse(&format!("{named}grpc:\n  address: 127.0.0.1:8787\n"))
            .unwrap_err()
            .to_string();
        assert!(error.contains("listeners[0].name"), "{error}");
    }
}

//! The endpoint picker listener (Gateway API Inference Extension): off unless an address is
//! given.

use std::net::SocketAddr;

use serde::Deserialize;

use crate::tls::check_listener_tls;
use crate::violation::{Checked, fail};
use crate::{Config, FieldPath, ListenerTlsConfig};

/// Name the endpoint picker listener is announced under (`LISTENING epp <addr>`).
pub const EPP_LISTENER: &str = "epp";

/// Most fallback endpoints accepted after the pick.
pub const MAX_EPP_FALLBACKS: usize = 16;

/// kvmesh as the endpoint picker (EPP) of a Gateway API `InferencePool`: Envoy's
/// `ext_proc` gRPC service (`envoy.service.ext_proc.v3.ExternalProcessor`, GAIE protocol
/// v1), with `grpc.health.v1` (`liveness`, `readiness`, the ext_proc service). A gateway
/// asks it which pod serves each request; it routes with the same models, policies, KV
/// index and load as the data listeners, and forwards nothing itself.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EppConfig {
    /// Address to bind; port 0 picks a free port; `null` (the default): no endpoint picker.
    pub address: Option<SocketAddr>,
    /// Endpoints named after the pick, in order, for the gateway to fall back on
    /// (`ip:port,ip:port,...`; 0: the pick alone).
    pub fallbacks: usize,
    /// Header (and dynamic metadata key) the pick is returned in.
    pub destination_header: String,
    /// Namespace of the pick's dynamic metadata, of the served endpoint the gateway
    /// reports, and (with `.subset_hint` appended) of the subset hint.
    pub metadata_namespace: String,
    /// TLS on the picker's port (`cert`, `key`, optional client CA as on a data listener);
    /// `null` (the default): the first TLS data listener's, or plaintext h2c.
    pub tls: Option<ListenerTlsConfig>,
}

impl Default for EppConfig {
    fn default() -> Self {
        Self {
            address: None,
            fallbacks: 2,
            destination_header: "x-gateway-destination-endpoint".to_string(),
            metadata_namespace: "envoy.lb".to_string(),
            tls: None,
        }
    }
}

/// Checks `epp`; `path` points at it.
pub(crate) fn check_epp(config: &Config, path: &FieldPath) -> Checked {
    let epp = &config.epp;
    if epp.fallbacks > MAX_EPP_FALLBACKS {
        return fail(
            path.key("fallbacks"),
            format!("must be at most {MAX_EPP_FALLBACKS}"),
        );
    }
    let header = &epp.destination_header;
    if header.is_empty()
        || !header
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return fail(
            path.key("destination_header"),
            "must be a lowercase header name (a-z, 0-9, -)",
        );
    }
    if epp.metadata_namespace.is_empty() {
        return fail(path.key("metadata_namespace"), "must not be empty");
    }
    if let Some(tls) = &epp.tls {
        check_listener_tls(tls, &path.key("tls"))?;
    }
    let Some(address) = epp.address else {
        return Ok(());
    };
    for (i, listener) in config.listeners.iter().enumerate() {
        if listener.name == EPP_LISTENER {
            return fail(
                FieldPath::root().key("listeners").index(i).key("name"),
                format!(
                    "{EPP_LISTENER:?} is reserved for the endpoint picker (epp.address is set)"
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
    let taken = [
        ("admin.address", Some(config.admin.address)),
        ("grpc.address", config.grpc.address),
    ];
    for (name, used) in taken {
        if address.port() != 0 && used == Some(address) {
            return fail(
                path.key("address"),
                format!("address {address} is already used by {name}"),
            );
        }
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
    fn off_by_default_with_the_protocol_defaults() {
        let config = parse("").unwrap();
        assert_eq!(config.epp.address, None);
        assert_eq!(config.epp.fallbacks, 2);
        assert_eq!(
            config.epp.destination_header,
            "x-gateway-destination-endpoint"
        );
        assert_eq!(config.epp.metadata_namespace, "envoy.lb");
    }

    #[test]
    fn parses_every_field() {
        let config = parse(
            "epp:\n  address: 127.0.0.1:9002\n  fallbacks: 0\n  destination_header: x-pick\n  \
             metadata_namespace: lb\n",
        )
        .unwrap();
        assert_eq!(
            config.epp,
            EppConfig {
                address: Some("127.0.0.1:9002".parse().unwrap()),
                fallbacks: 0,
                destination_header: "x-pick".to_string(),
                metadata_namespace: "lb".to_string(),
                tls: None,
            }
        );
    }

    #[test]
    fn rejects_bad_values_with_their_field() {
        for (yaml, field) in [
            ("epp:\n  fallbacks: 17\n", "epp.fallbacks"),
            (
                "epp:\n  destination_header: X-Pick\n",
                "epp.destination_header",
            ),
            ("epp:\n  destination_header: ''\n", "epp.destination_header"),
            ("epp:\n  metadata_namespace: ''\n", "epp.metadata_namespace"),
            (
                "epp:\n  tls:\n    cert: /no/such.pem\n    key: /no/such.key\n",
                "epp.tls.cert",
            ),
            (
                "admin:\n  address: 127.0.0.1:9999\nepp:\n  address: 127.0.0.1:9999\n",
                "epp.address",
            ),
            (
                "grpc:\n  address: 127.0.0.1:9998\nepp:\n  address: 127.0.0.1:9998\n",
                "epp.address",
            ),
            (
                "listeners:\n  - name: epp\n    address: 127.0.0.1:0\nepp:\n  address: 127.0.0.1:0\n",
                "listeners[0].name",
            ),
        ] {
            let error = parse(yaml).unwrap_err().to_string();
            assert!(error.contains(field), "{yaml}: {error}");
        }
    }

    #[test]
    fn an_endpoint_picker_alone_needs_no_data_listener() {
        assert!(parse("listeners: []\nepp:\n  address: 127.0.0.1:0\n").is_ok());
        let error = parse("listeners: []\n").unwrap_err().to_string();
        assert!(error.contains("listeners"), "{error}");
    }
}

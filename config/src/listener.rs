//! Listener sections: the data listeners clients connect to and the admin listener.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use serde::Deserialize;

use crate::ListenerTlsConfig;

/// One data listener (OpenAI HTTP API): HTTP/1.1 and h2c on the same port, or
/// with `tls`, HTTPS with HTTP/2 and HTTP/1.1 by ALPN.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ListenerConfig {
    /// Name announced on stdout (`LISTENING <name> <addr>`); letters, digits, `-`, `_`.
    pub name: String,
    /// Address to bind; port 0 picks a free port.
    pub address: SocketAddr,
    /// TLS termination; `null` (the default): plaintext.
    pub tls: Option<ListenerTlsConfig>,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        Self {
            name: "main".to_string(),
            address: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 8080)),
            tls: None,
        }
    }
}

/// The admin listener: `/metrics`, `/health`, `/live`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Address to bind; port 0 picks a free port.
    pub address: SocketAddr,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            address: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9090)),
        }
    }
}

//! Errors that stop the proxy from starting.

use std::net::SocketAddr;

use kvmesh_config::ConfigError;

use crate::edge::tls::TlsError;

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A TLS setting's file cannot be used.
    #[error("TLS config error: {0}")]
    Tls(#[from] TlsError),
    /// A backend's host name did not resolve.
    #[error("cannot resolve backend {url}: {reason}")]
    Resolve {
        /// The backend URL.
        url: String,
        /// The resolver's answer.
        reason: String,
    },
    /// A listener could not bind its address.
    #[error("listener {name:?} cannot bind {address}: {source}")]
    Bind {
        /// The listener's name.
        name: String,
        /// The configured address.
        address: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// A model's tokenizer directory could not be loaded.
    #[error("model {model:?}: cannot load the tokenizer from {dir}: {reason}")]
    Tokenizer {
        /// The model.
        model: String,
        /// The configured directory.
        dir: String,
        /// What went wrong.
        reason: String,
    },
    /// A model's `kv` settings were rejected by the KV index.
    #[error("model {model:?}: invalid kv settings: {reason}")]
    KvSettings {
        /// The model.
        model: String,
        /// What is wrong.
        reason: String,
    },
    /// The preprocessing threads could not be started.
    #[error("cannot start the preprocessing threads: {0}")]
    Threads(std::io::Error),
    /// The metrics registry rejected a metric (a bug).
    #[error("metrics setup failed: {0}")]
    Metrics(#[from] prometheus::Error),
    /// Discovery or the event bus could not be set up.
    #[error("control plane: {0}")]
    ControlPlane(String),
    /// The gRPC listener could not be set up or failed.
    #[error("gRPC listener: {0}")]
    Grpc(String),
    /// Tracing could not start (`telemetry`).
    #[error("telemetry: {0}")]
    Telemetry(kvmesh_telemetry::TelemetryError),
}

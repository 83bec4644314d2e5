//! Errors of starting an agent.

use thiserror::Error;

/// Why an agent could not start.
#[derive(Debug, Error)]
pub enum AgentError {
    /// A setting is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: std::net::SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The control plane refused something.
    #[error(transparent)]
    Control(#[from] kvmesh_control::ControlError),
    /// Start-up did not finish in time.
    #[error("start-up timed out: {0}")]
    Startup(String),
    /// Metrics could not be created.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// Tracing could not start.
    #[error("tracing: {0}")]
    Telemetry(#[from] kvmesh_telemetry::TelemetryError),
}

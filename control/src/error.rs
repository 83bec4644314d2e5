//! Errors of the control plane: codecs, names, and the etcd / NATS / in-process backends.

use thiserror::Error;

/// Anything a control-plane operation can fail with.
#[derive(Debug, Error)]
pub enum ControlError {
    /// Client settings are unusable (a TLS or secret file missing, half a key pair).
    #[error("{0}")]
    Config(String),
    /// A name (namespace, model, subject, key) is not acceptable.
    #[error("invalid name: {0}")]
    InvalidName(String),
    /// A payload could not be encoded or decoded as the contract's JSON.
    #[error("invalid payload: {0}")]
    Codec(#[from] serde_json::Error),
    /// A message is well-formed but breaks the contract (a reply's parts out of order).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The backend is not connected right now (it keeps reconnecting in the background).
    #[error("not connected to {0}")]
    Disconnected(&'static str),
    /// No answer within the deadline.
    #[error("{0} timed out")]
    Timeout(&'static str),
    /// No one serves the subject a request went to (or the bus closed meanwhile).
    #[error("no responder on {0}")]
    NoResponders(String),
    /// The lease does not exist (expired, revoked, or the store lost it).
    #[error("lease {0:x} not found")]
    LeaseNotFound(i64),
    /// A message is larger than the server accepts.
    #[error("payload of {size} bytes exceeds the server's limit of {limit} bytes")]
    PayloadTooLarge {
        /// Size of the rejected payload.
        size: usize,
        /// The server's limit.
        limit: usize,
    },
    /// The server refused the client's credentials or certificate, or denied it the
    /// operation: retrying with the same settings will not help.
    #[error("{backend} refused the client: {message}")]
    Refused {
        /// `etcd` or `nats`.
        backend: &'static str,
        /// What it said.
        message: String,
    },
    /// The server refused a request or answered something unexpected.
    #[error("{backend} server error: {message}")]
    Server {
        /// `etcd` or `nats`.
        backend: &'static str,
        /// What it said.
        message: String,
    },
    /// A transport (TCP, HTTP) failure.
    #[error("{backend} transport error: {message}")]
    Transport {
        /// `etcd` or `nats`.
        backend: &'static str,
        /// The underlying error.
        message: String,
    },
    /// The client was shut down.
    #[error("the client is closed")]
    Closed,
}

//! The library's error type.

use std::net::SocketAddr;

/// Why an engine could not be configured or started.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A [`crate::SimConfig`] field is out of range.
    #[error("invalid engine configuration: {0}")]
    InvalidConfig(String),
    /// The Hugging Face tokenizer file could not be loaded.
    #[error("cannot load tokenizer {path}: {message}")]
    Tokenizer {
        /// The configured `tokenizer.json` path.
        path: String,
        /// What the tokenizers crate reported.
        message: String,
    },
    /// A listening socket could not be bound.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The ZMQ KV event sockets could not be started.
    #[error("KV event publishing: {0}")]
    KvEvents(String),
    /// Another socket operation failed (e.g. reading the bound address).
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
}

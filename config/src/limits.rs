//! Request size limits and timeouts.

use std::time::Duration;

use serde::Deserialize;

/// Largest accepted `limits.max_header_bytes` (the HTTP/1 parser's own limit).
pub(crate) const MAX_HEADER_BYTES: u64 = 1_048_575;
/// Largest accepted `limits.max_headers` (the HTTP/1 parser's own limit).
pub(crate) const MAX_HEADERS: usize = 256;

/// Limits applied to every proxied request.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest accepted request body in bytes (larger: 413).
    pub max_body_bytes: u64,
    /// Time allowed to open a TCP connection to a backend.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub connect_timeout: Duration,
    /// Time allowed from sending the request to receiving the response headers (then: 504).
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub first_byte_timeout: Duration,
    /// Longest gap allowed between two upstream response body chunks.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub idle_timeout: Duration,
    /// Longest a client may take to accept one piece of its answer (a client that stopped
    /// reading): the answer is then cut, the connection closed and the engine's request
    /// cancelled, so a stalled reader holds no engine slot, booking or buffer for long.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub write_timeout: Duration,
    /// Extra instances tried when connecting fails before any response byte.
    pub retries: u32,
    /// Time a client has to send its request head and body; a slower client is
    /// answered 408 and disconnected.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub client_header_timeout: Duration,
    /// Largest request head (request line, header names and values) in bytes
    /// (larger: 431); at most 1048575.
    pub max_header_bytes: u64,
    /// Most request header fields (more: 431); at most 256.
    pub max_headers: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 10 * 1024 * 1024,
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(30),
            retries: 2,
            client_header_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
            max_headers: 100,
        }
    }
}

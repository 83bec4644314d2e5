//! Graceful shutdown.

use std::time::Duration;

use serde::Deserialize;

/// What happens on SIGTERM / SIGINT: stop accepting, let in-flight requests finish.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    /// Longest wait for in-flight requests and streams before exiting anyway.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub drain_timeout: Duration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            drain_timeout: Duration::from_secs(30),
        }
    }
}

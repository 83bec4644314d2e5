//! Upstream connection pooling.

use std::time::Duration;

use serde::Deserialize;

use crate::UpstreamTlsConfig;

/// Keep-alive connections to backends.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Idle keep-alive connections kept per backend instance (one pool of
    /// `pool_size × instances`, shared least-recently-used).
    pub pool_size: usize,
    /// How long an idle pooled connection is kept before it is closed.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub pool_idle_timeout: Duration,
    /// TLS to `https://` backends.
    pub tls: UpstreamTlsConfig,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            pool_size: 128,
            pool_idle_timeout: Duration::from_secs(90),
            tls: UpstreamTlsConfig::default(),
        }
    }
}

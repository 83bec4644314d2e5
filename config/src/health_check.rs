//! Active health checks.

use std::time::Duration;

use serde::Deserialize;

/// Periodic `GET <backend><path>` probes; a 2xx answer is a success.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthCheckConfig {
    /// Whether probes run at all (when off, every backend counts as healthy).
    pub enabled: bool,
    /// Path probed on every backend; starts with `/`.
    pub path: String,
    /// Time between two probes of one backend.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub interval: Duration,
    /// Time allowed for one probe (connect + response headers).
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub timeout: Duration,
    /// Consecutive failed probes that mark a healthy backend unhealthy.
    pub unhealthy_threshold: u32,
    /// Consecutive successful probes that mark an unhealthy backend healthy.
    pub healthy_threshold: u32,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            path: "/health".to_string(),
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(1),
            unhealthy_threshold: 2,
            healthy_threshold: 1,
        }
    }
}

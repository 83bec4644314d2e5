//! Passive outlier detection (ejection of failing backends).

use std::time::Duration;

use serde::Deserialize;

/// Ejects a backend after consecutive failures seen on real traffic.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OutlierDetectionConfig {
    /// Consecutive failures that eject a backend: 5xx responses, connect errors,
    /// resets and timeouts (4xx responses never count); 0 turns ejection off.
    pub consecutive_failures: u32,
    /// Length of the first ejection; each re-ejection doubles it.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub base_ejection_time: Duration,
    /// Upper bound of the doubled ejection time.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub max_ejection_time: Duration,
}

impl Default for OutlierDetectionConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_ejection_time: Duration::from_secs(5),
            max_ejection_time: Duration::from_secs(120),
        }
    }
}

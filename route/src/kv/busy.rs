//! Busy thresholds (kv-routing §6): an instance whose *current* load is past a threshold takes
//! no new requests until it drops below; when every instance is busy the request waits in the
//! admission queue or gets 503.

use kvmesh_config::KvRoutingConfig;

/// The thresholds of one model; each `None` when off.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct BusyThresholds {
    /// Busy when active blocks exceed this fraction of the instance's KV capacity.
    pub(crate) decode_fraction: Option<f64>,
    /// The capacity of an instance whose engine did not report one (`kv.total_kv_blocks`).
    pub(crate) default_capacity: Option<u64>,
    /// Busy when active prefill tokens exceed this.
    pub(crate) prefill_tokens: Option<u64>,
}

impl BusyThresholds {
    /// The thresholds a model's `kv` settings turn on.
    pub(crate) fn from_config(config: &KvRoutingConfig) -> Self {
        Self {
            decode_fraction: config.busy_decode_blocks_fraction.filter(|&f| f > 0.0),
            default_capacity: config.total_kv_blocks.filter(|&total| total > 0),
            prefill_tokens: config.busy_prefill_tokens_limit(),
        }
    }

    /// Whether an instance with these active loads is busy; `capacity`: its KV cache size
    /// in blocks as its engine reported it (0: unknown, then `kv.total_kv_blocks`).
    pub(crate) fn is_busy(
        &self,
        active_blocks: u64,
        active_prefill_tokens: u64,
        capacity: u64,
    ) -> bool {
        let capacity = Some(capacity).filter(|&c| c > 0).or(self.default_capacity);
        let decode_limit = self
            .decode_fraction
            .zip(capacity)
            .map(|(fraction, capacity)| fraction * capacity as f64);
        decode_limit.is_some_and(|limit| active_blocks as f64 > limit)
            || self
                .prefill_tokens
                .is_some_and(|limit| active_prefill_tokens > limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_threshold_alone_makes_busy() {
        let both = BusyThresholds {
            decode_fraction: Some(0.5),
            default_capacity: Some(200),
            prefill_tokens: Some(1000),
        };
        assert!(!both.is_busy(100, 1000, 0));
        assert!(both.is_busy(101, 0, 0));
        assert!(both.is_busy(0, 1001, 0));
        let off = BusyThresholds::default();
        assert!(!off.is_busy(u64::MAX, u64::MAX, 10));
    }

    #[test]
    fn a_reported_capacity_replaces_the_default() {
        let thresholds = BusyThresholds {
            decode_fraction: Some(0.5),
            default_capacity: Some(200),
            prefill_tokens: None,
        };
        assert!(thresholds.is_busy(101, 0, 0), "the default: 100 blocks");
        assert!(!thresholds.is_busy(101, 0, 1000), "its own: 500 blocks");
        assert!(thresholds.is_busy(101, 0, 100), "a small engine: 50 blocks");
        let no_default = BusyThresholds {
            default_capacity: None,
            ..thresholds
        };
        assert!(
            !no_default.is_busy(u64::MAX, 0, 0),
            "no capacity known: off"
        );
        assert!(no_default.is_busy(51, 0, 100));
    }

    #[test]
    fn thresholds_come_from_the_config() {
        let config = KvRoutingConfig {
            total_kv_blocks: Some(1000),
            busy_decode_blocks_fraction: Some(0.5),
            busy_prefill_tokens: None,
            ..KvRoutingConfig::default()
        };
        let thresholds = BusyThresholds::from_config(&config);
        assert_eq!(thresholds.decode_fraction, Some(0.5));
        assert_eq!(thresholds.default_capacity, Some(1000));
        assert_eq!(thresholds.prefill_tokens, None);
        assert!(thresholds.is_busy(501, u64::MAX / 2, 0));
    }
}

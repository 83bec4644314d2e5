//! Busy thresholds (kv-routing §6): an instance whose *current* load is past a threshold takes
//! no new requests until it drops below; when every instance is busy the request waits in the
//! admission queue or gets 503.

use kvmesh_config::KvRoutingConfig;

/// The thresholds of one model; each `None` when off.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct BusyThresholds {
    /// Busy when active blocks exceed this (`busy_decode_blocks_fraction × total_kv_blocks`).
    pub(crate) decode_blocks: Option<f64>,
    /// Busy when active prefill tokens exceed this.
    pub(crate) prefill_tokens: Option<u64>,
}

impl BusyThresholds {
    /// The thresholds a model's `kv` settings turn on.
    pub(crate) fn from_config(config: &KvRoutingConfig) -> Self {
        Self {
            decode_blocks: config.busy_decode_blocks(),
            prefill_tokens: config.busy_prefill_tokens_limit(),
        }
    }

    /// Whether an instance with these active loads is busy.
    pub(crate) fn is_busy(&self, active_blocks: u64, active_prefill_tokens: u64) -> bool {
        self.decode_blocks
            .is_some_and(|limit| active_blocks as f64 > limit)
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
            decode_blocks: Some(100.0),
            prefill_tokens: Some(1000),
        };
        assert!(!both.is_busy(100, 1000));
        assert!(both.is_busy(101, 0));
        assert!(both.is_busy(0, 1001));
        let off = BusyThresholds::default();
        assert!(!off.is_busy(u64::MAX, u64::MAX));
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
        assert_eq!(thresholds.decode_blocks, Some(500.0));
        assert_eq!(thresholds.prefill_tokens, None);
        assert!(thresholds.is_busy(501, u64::MAX / 2));
    }
}

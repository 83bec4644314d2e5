//! Settings of the approximate (event-less) mode.

use std::time::Duration;

use crate::error::ApproxConfigError;

/// Default lifetime of a predicted block: 120 s (Dynamo's `--router-ttl-secs`).
pub const DEFAULT_TTL: Duration = Duration::from_secs(120);
/// Default bound on predicted (worker, block) pairs: 2^20 (Dynamo's `--router-max-tree-size`).
pub const DEFAULT_MAX_BLOCKS: usize = 1 << 20;
/// Default fraction of the bound to prune down to: 0.8 (`--router-prune-target-ratio`).
pub const DEFAULT_PRUNE_TARGET_RATIO: f64 = 0.8;
/// Longest accepted TTL (one year), so expiry instants never overflow.
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// Settings of [`crate::ApproxIndex`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ApproxConfig {
    /// How long a predicted block stays in the index after its last routing decision.
    pub ttl: Duration,
    /// Most (worker, block) pairs kept; exceeding it triggers pruning.
    pub max_blocks: usize,
    /// Pruning removes pairs until at most `floor(max_blocks × ratio)` are left.
    pub prune_target_ratio: f64,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            max_blocks: DEFAULT_MAX_BLOCKS,
            prune_target_ratio: DEFAULT_PRUNE_TARGET_RATIO,
        }
    }
}

impl ApproxConfig {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), ApproxConfigError> {
        if self.ttl.is_zero() {
            return Err(ApproxConfigError::ZeroTtl);
        }
        if self.ttl > MAX_TTL {
            return Err(ApproxConfigError::TtlTooLong(self.ttl));
        }
        if self.max_blocks == 0 {
            return Err(ApproxConfigError::ZeroMaxBlocks);
        }
        let ratio = self.prune_target_ratio;
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(ApproxConfigError::PruneRatio(ratio));
        }
        Ok(())
    }

    /// The number of pairs pruning leaves: `floor(max_blocks × prune_target_ratio)`.
    pub fn prune_target(&self) -> usize {
        // A ratio in (0, 1] keeps the product within 0..=max_blocks.
        (self.max_blocks as f64 * self.prune_target_ratio) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_match_dynamo() {
        let config = ApproxConfig::default();
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.prune_target(), 838_860);
    }

    #[test]
    fn invalid_settings_are_rejected() {
        let ok = ApproxConfig::default();
        let cases = [
            (
                ApproxConfig {
                    ttl: Duration::ZERO,
                    ..ok
                },
                ApproxConfigError::ZeroTtl,
            ),
            (
                ApproxConfig {
                    ttl: MAX_TTL * 2,
                    ..ok
                },
                ApproxConfigError::TtlTooLong(MAX_TTL * 2),
            ),
            (
                ApproxConfig {
                    max_blocks: 0,
                    ..ok
                },
                ApproxConfigError::ZeroMaxBlocks,
            ),
            (
                ApproxConfig {
                    prune_target_ratio: 0.0,
                    ..ok
                },
                ApproxConfigError::PruneRatio(0.0),
            ),
            (
                ApproxConfig {
                    prune_target_ratio: 1.5,
                    ..ok
                },
                ApproxConfigError::PruneRatio(1.5),
            ),
        ];
        for (config, error) in cases {
            assert_eq!(config.validate(), Err(error));
        }
        let nan = ApproxConfig {
            prune_target_ratio: f64::NAN,
            ..ok
        };
        assert!(nan.validate().is_err());
    }
}

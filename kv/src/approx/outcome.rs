//! Counts of what approximate-mode calls did.

use std::ops::AddAssign;

/// What one approximate-mode call (or a running total of them) did to the predictions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApproxOutcome {
    /// (worker, block) pairs predicted for the first time.
    pub inserted: u64,
    /// Pairs already predicted whose expiry was pushed back.
    pub refreshed: u64,
    /// Pairs dropped because their TTL ran out.
    pub expired: u64,
    /// Pairs dropped to bring the total back under the size bound.
    pub pruned: u64,
}

impl AddAssign for ApproxOutcome {
    fn add_assign(&mut self, other: Self) {
        self.inserted += other.inserted;
        self.refreshed += other.refreshed;
        self.expired += other.expired;
        self.pruned += other.pruned;
    }
}

/// Current size and running totals of an approximate index, for gauges and counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApproxStats {
    /// (worker, block) pairs currently predicted.
    pub predicted_blocks: usize,
    /// Everything done since the index was created.
    pub totals: ApproxOutcome,
}

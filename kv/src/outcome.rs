//! What applying events did, counted per outcome for metrics.

use std::ops::AddAssign;

/// Counts of what one or more applied events did.
///
/// Add outcomes together (`+=`) to keep running totals. Label values for a Prometheus counter
/// come from [`ApplyOutcome::status`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks attached by Stored events (including re-stores of blocks already held).
    pub blocks_stored: u64,
    /// Blocks dropped by Removed events.
    pub blocks_removed: u64,
    /// Blocks dropped by Cleared events and worker removals.
    pub blocks_cleared: u64,
    /// Stored events whose parent block this worker did not hold (or held under another
    /// sequence hash). Their blocks are still attached, as orphans until the parent arrives;
    /// a non-zero count means the index missed events for this worker.
    pub parent_not_found: u64,
    /// Removed block ids this worker did not hold (skipped).
    pub blocks_not_found: u64,
    /// Stored blocks rejected because their sequence hash does not chain from their parent's,
    /// or (a 64-bit hash collision) equals it or is already recorded under another parent.
    /// The rest of that event's chain is rejected with them.
    pub blocks_invalid: u64,
}

/// The worst thing that happened in an [`ApplyOutcome`], for a per-event status label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApplyStatus {
    /// Everything applied.
    Ok,
    /// A Stored event's parent was unknown (its blocks were still attached).
    ParentNotFound,
    /// A Removed event named a block the worker did not hold.
    BlockNotFound,
    /// Blocks were rejected as invalid.
    Invalid,
}

impl ApplyStatus {
    /// A stable lower-case label for metrics: `ok`, `parent_not_found`, `block_not_found`,
    /// `invalid`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::ParentNotFound => "parent_not_found",
            Self::BlockNotFound => "block_not_found",
            Self::Invalid => "invalid",
        }
    }
}

impl ApplyOutcome {
    /// The worst status: invalid, then parent not found, then block not found, else ok.
    pub fn status(&self) -> ApplyStatus {
        if self.blocks_invalid > 0 {
            ApplyStatus::Invalid
        } else if self.parent_not_found > 0 {
            ApplyStatus::ParentNotFound
        } else if self.blocks_not_found > 0 {
            ApplyStatus::BlockNotFound
        } else {
            ApplyStatus::Ok
        }
    }

    /// Whether the counts suggest the index diverged from the worker (a missed Stored event, an
    /// invalid block), so the worker's state should be re-synchronised.
    pub fn suggests_resync(&self) -> bool {
        self.parent_not_found > 0 || self.blocks_invalid > 0
    }
}

impl AddAssign for ApplyOutcome {
    fn add_assign(&mut self, other: Self) {
        self.blocks_stored += other.blocks_stored;
        self.blocks_removed += other.blocks_removed;
        self.blocks_cleared += other.blocks_cleared;
        self.parent_not_found += other.parent_not_found;
        self.blocks_not_found += other.blocks_not_found;
        self.blocks_invalid += other.blocks_invalid;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_picks_the_worst_outcome() {
        let mut outcome = ApplyOutcome {
            blocks_stored: 3,
            ..ApplyOutcome::default()
        };
        assert_eq!(outcome.status(), ApplyStatus::Ok);
        outcome.blocks_not_found = 1;
        assert_eq!(outcome.status(), ApplyStatus::BlockNotFound);
        assert!(!outcome.suggests_resync());
        outcome.parent_not_found = 1;
        assert_eq!(outcome.status(), ApplyStatus::ParentNotFound);
        assert!(outcome.suggests_resync());
        outcome.blocks_invalid = 2;
        assert_eq!(outcome.status().as_str(), "invalid");
    }

    #[test]
    fn outcomes_add_up() {
        let mut total = ApplyOutcome::default();
        let one = ApplyOutcome {
            blocks_stored: 1,
            blocks_removed: 2,
            blocks_cleared: 3,
            parent_not_found: 4,
            blocks_not_found: 5,
            blocks_invalid: 6,
        };
        total += one;
        total += one;
        assert_eq!(total.blocks_stored, 2);
        assert_eq!(total.blocks_invalid, 12);
        assert_eq!(total.blocks_cleared, 6);
    }
}

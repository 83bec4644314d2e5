//! Test-only fault injection shared by the admin endpoint and the publisher.

use std::sync::atomic::{AtomicU64, Ordering};

/// Faults still to apply to the next published batches.
#[derive(Debug, Default)]
pub(crate) struct FaultControl {
    drop_batches: AtomicU64,
    duplicate_stores: AtomicU64,
}

/// Takes one unit from `counter` when it is positive.
fn take_one(counter: &AtomicU64) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
        .is_ok()
}

impl FaultControl {
    /// Withholds the next `n` batches from the PUB socket (their sequence numbers are still
    /// used, so subscribers see a gap; the replay socket still has them).
    pub(crate) fn drop_batches(&self, n: u64) {
        self.drop_batches.fetch_add(n, Ordering::AcqRel);
    }

    /// Publishes the first `BlockStored` event of each of the next `n` batches that have one a
    /// second time, in a batch of its own right after.
    pub(crate) fn duplicate_stores(&self, n: u64) {
        self.duplicate_stores.fetch_add(n, Ordering::AcqRel);
    }

    /// Whether the batch about to be sent must be withheld.
    pub(crate) fn take_drop(&self) -> bool {
        take_one(&self.drop_batches)
    }

    /// Whether the store just sent must be sent again.
    pub(crate) fn take_duplicate(&self) -> bool {
        take_one(&self.duplicate_stores)
    }

    /// Faults not applied yet: `(batches to drop, stores to duplicate)`.
    pub(crate) fn pending(&self) -> (u64, u64) {
        (
            self.drop_batches.load(Ordering::Acquire),
            self.duplicate_stores.load(Ordering::Acquire),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_consumed_one_at_a_time() {
        let c = FaultControl::default();
        assert!(!c.take_drop() && !c.take_duplicate());
        c.drop_batches(2);
        c.duplicate_stores(1);
        assert_eq!(c.pending(), (2, 1));
        assert!(c.take_drop() && c.take_drop() && !c.take_drop());
        assert!(c.take_duplicate() && !c.take_duplicate());
        assert_eq!(c.pending(), (0, 0));
    }
}

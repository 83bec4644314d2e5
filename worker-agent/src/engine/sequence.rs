//! Tracking an engine publisher's sequence numbers (8-byte big-endian, from 0, +1 per batch).

/// What to do with a batch given its engine sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqAction {
    /// The next batch: apply it.
    Apply,
    /// The first batch seen, numbered `seq` > 0: the agent started after the engine. Replay
    /// `0..seq` first (when the engine has a replay socket), then apply it.
    CatchUp {
        /// The first missed number (0).
        from: u64,
    },
    /// Batches `from..seq` were lost: replay them, then apply this one.
    Gap {
        /// The first missed number.
        from: u64,
    },
    /// The number went back to 0: the engine restarted. Forget its blocks, then apply.
    Restart,
    /// Already applied (a duplicate or a replayed batch arriving live): skip.
    Skip,
}

/// The last applied sequence number of one engine publisher.
#[derive(Debug, Clone, Copy, Default)]
pub struct SeqTracker {
    last: Option<u64>,
}

impl SeqTracker {
    /// Classifies a live batch numbered `seq` (does not record it).
    pub fn check(&self, seq: u64) -> SeqAction {
        match self.last {
            None if seq == 0 => SeqAction::Apply,
            None => SeqAction::CatchUp { from: 0 },
            Some(last) if seq == last.wrapping_add(1) => SeqAction::Apply,
            Some(_) if seq == 0 => SeqAction::Restart,
            Some(last) if seq <= last => SeqAction::Skip,
            Some(last) => SeqAction::Gap { from: last + 1 },
        }
    }

    /// Records that batch `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.last = Some(seq);
    }

    /// The last applied number.
    pub fn last(&self) -> Option<u64> {
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_engine_sequence_numbers() {
        let mut t = SeqTracker::default();
        assert_eq!(t.check(0), SeqAction::Apply);
        assert_eq!(t.check(5), SeqAction::CatchUp { from: 0 });
        t.applied(0);
        assert_eq!(t.check(1), SeqAction::Apply);
        t.applied(1);
        assert_eq!(t.check(1), SeqAction::Skip);
        assert_eq!(t.check(4), SeqAction::Gap { from: 2 });
        assert_eq!(t.check(0), SeqAction::Restart);
        t.applied(4);
        assert_eq!(t.last(), Some(4));
    }
}

//! Round robin: each instance in turn, skipping ineligible ones.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{CandidateSet, Policy};

/// Each eligible instance in turn.
#[derive(Debug, Default)]
pub(crate) struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn pick(&self, candidates: &dyn CandidateSet) -> Option<usize> {
        let len = candidates.len();
        if len == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % len;
        (0..len)
            .map(|step| (start + step) % len)
            .find(|&i| candidates.is_eligible(i))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{Fake, histogram};
    use super::*;

    #[test]
    fn cycles_through_instances() {
        let policy = RoundRobin::default();
        let set = Fake(vec![(true, 0), (true, 0), (true, 0)]);
        let picks: Vec<_> = (0..6).map(|_| policy.pick(&set).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn skips_ineligible_instances() {
        let policy = RoundRobin::default();
        let set = Fake(vec![(true, 0), (false, 0), (true, 0), (true, 0)]);
        // The instance after a skipped one takes its turns.
        assert_eq!(histogram(&policy, &set, 400), vec![100, 0, 200, 100]);
    }
}

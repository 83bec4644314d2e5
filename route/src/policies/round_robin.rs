//! Round robin: each instance in turn, skipping ineligible ones.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::picked;
use crate::candidates::CandidateSet;
use crate::policy::{NoPick, Picked, Policy, PolicyInput};

/// Each eligible instance in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn pick<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        _input: &PolicyInput,
    ) -> Result<Picked<'_>, NoPick> {
        let len = candidates.len();
        if len == 0 {
            return Err(NoPick::Nothing);
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % len;
        picked(
            (0..len)
                .map(|step| (start + step) % len)
                .find(|&i| candidates.is_eligible(i)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{Fake, histogram, pick};
    use super::*;

    #[test]
    fn cycles_through_instances() {
        let policy = RoundRobin::default();
        let set = Fake(vec![(true, 0), (true, 0), (true, 0)]);
        let picks: Vec<_> = (0..6).map(|_| pick(&policy, &set).unwrap()).collect();
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

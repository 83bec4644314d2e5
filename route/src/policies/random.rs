//! Random: a uniformly random eligible instance.

use super::{picked, random_eligible};
use crate::candidates::CandidateSet;
use crate::policy::{NoPick, Picked, Policy, PolicyInput};

/// A uniformly random eligible instance.
#[derive(Debug, Default)]
pub struct Random;

impl Policy for Random {
    fn pick<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        _input: &PolicyInput,
    ) -> Result<Picked<'_>, NoPick> {
        picked(random_eligible(candidates, &mut rand::thread_rng()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{Fake, histogram};
    use super::*;

    #[test]
    fn spreads_evenly_over_eligible_instances() {
        let set = Fake(vec![(true, 0), (false, 0), (true, 0), (true, 0)]);
        let counts = histogram(&Random, &set, 30_000);
        assert_eq!(counts[1], 0);
        for i in [0, 2, 3] {
            assert!((9_000..11_000).contains(&counts[i]), "{counts:?}");
        }
    }
}

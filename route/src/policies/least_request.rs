//! Least request: the eligible instance with the fewest requests in flight.

use rand::Rng;

use super::picked;
use crate::candidates::CandidateSet;
use crate::policy::{NoPick, Picked, Policy, PolicyInput};

/// The eligible instance with the fewest requests in flight; ties are broken
/// at random so idle fleets do not pile onto the first instance.
#[derive(Debug, Default)]
pub struct LeastRequest;

impl Policy for LeastRequest {
    fn pick<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        _input: &PolicyInput,
    ) -> Result<Picked<'_>, NoPick> {
        let mut rng = rand::thread_rng();
        let mut best: Option<(usize, u64)> = None;
        let mut ties = 0u32;
        for i in (0..candidates.len()).filter(|&i| candidates.is_eligible(i)) {
            let load = candidates.in_flight(i);
            match best {
                Some((_, least)) if load > least => {}
                Some((_, least)) if load == least => {
                    ties += 1;
                    if rng.gen_range(0..ties) == 0 {
                        best = Some((i, load));
                    }
                }
                _ => {
                    best = Some((i, load));
                    ties = 1;
                }
            }
        }
        picked(best.map(|(i, _)| i))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{Fake, histogram};
    use super::*;

    #[test]
    fn picks_the_least_loaded() {
        let set = Fake(vec![(true, 5), (true, 2), (false, 0), (true, 7)]);
        assert_eq!(histogram(&LeastRequest, &set, 100), vec![0, 100, 0, 0]);
    }

    #[test]
    fn breaks_ties_at_random() {
        let set = Fake(vec![(true, 1), (true, 4), (true, 1), (true, 1)]);
        let counts = histogram(&LeastRequest, &set, 30_000);
        assert_eq!(counts[1], 0);
        for i in [0, 2, 3] {
            assert!((9_000..11_000).contains(&counts[i]), "{counts:?}");
        }
    }
}

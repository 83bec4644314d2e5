//! Power of two choices: the less loaded of two random eligible instances.

use rand::Rng;

use super::picked;
use crate::candidates::CandidateSet;
use crate::policy::{NoPick, Picked, Policy, PolicyInput};

/// Samples two distinct eligible instances and takes the one with fewer
/// requests in flight.
#[derive(Debug, Default)]
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn pick<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        _input: &PolicyInput,
    ) -> Result<Picked<'_>, NoPick> {
        let count = candidates.eligible_count();
        let mut rng = rand::thread_rng();
        picked(match count {
            0 => None,
            1 => candidates.nth_eligible(0),
            _ => {
                let first = rng.gen_range(0..count);
                let mut second = rng.gen_range(0..count - 1);
                if second >= first {
                    second += 1;
                }
                match (
                    candidates.nth_eligible(first),
                    candidates.nth_eligible(second),
                ) {
                    (Some(a), Some(b)) if candidates.in_flight(b) < candidates.in_flight(a) => {
                        Some(b)
                    }
                    (Some(a), Some(_)) => Some(a),
                    _ => None,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{Fake, histogram, pick};
    use super::*;

    #[test]
    fn of_two_always_takes_the_less_loaded() {
        let set = Fake(vec![(true, 3), (false, 0), (true, 1)]);
        assert_eq!(histogram(&PowerOfTwo, &set, 200), vec![0, 0, 200]);
    }

    #[test]
    fn never_picks_the_most_loaded_of_many() {
        let set = Fake(vec![(true, 0), (true, 1), (true, 2), (true, 9)]);
        let counts = histogram(&PowerOfTwo, &set, 12_000);
        assert_eq!(counts[3], 0, "{counts:?}");
        // The idle instance wins every pair it is in: half of all pairs.
        assert!((5_400..6_600).contains(&counts[0]), "{counts:?}");
        assert!(counts[1] > counts[2], "{counts:?}");
    }

    #[test]
    fn a_single_eligible_instance_is_picked() {
        let set = Fake(vec![(false, 0), (true, 100)]);
        assert_eq!(pick(&PowerOfTwo, &set), Some(1));
    }
}

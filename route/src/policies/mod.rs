//! One file per policy. Four look at the instances only (round robin, random, least request,
//! power of two); [`kv`] looks at each request's prompt too.

mod kv;
mod least_request;
mod power_of_two;
mod random;
mod round_robin;

use rand::Rng;

use crate::candidates::CandidateSet;
use crate::policy::{NoPick, Picked};

pub use least_request::LeastRequest;
pub use power_of_two::PowerOfTwo;
pub use random::Random;
pub use round_robin::RoundRobin;

/// A uniformly random eligible instance.
fn random_eligible<S: CandidateSet + ?Sized>(candidates: &S, rng: &mut impl Rng) -> Option<usize> {
    let count = candidates.eligible_count();
    if count == 0 {
        return None;
    }
    candidates.nth_eligible(rng.gen_range(0..count))
}

/// The pick of a policy that books and explains nothing.
#[inline]
fn picked(index: Option<usize>) -> Result<Picked<'static>, NoPick> {
    index.map(Picked::index).ok_or(NoPick::Nothing)
}

#[cfg(test)]
pub(crate) mod test_support {
    //! A fake candidate set for policy tests.

    use crate::candidates::CandidateSet;
    use crate::policy::{Policy, PolicyInput};

    /// Instances described by (eligible, in flight).
    pub(crate) struct Fake(pub(crate) Vec<(bool, u64)>);

    impl CandidateSet for Fake {
        fn len(&self) -> usize {
            self.0.len()
        }

        fn is_eligible(&self, index: usize) -> bool {
            self.0[index].0
        }

        fn in_flight(&self, index: usize) -> u64 {
            self.0[index].1
        }

        fn id(&self, index: usize) -> u64 {
            index as u64
        }

        fn url(&self, _index: usize) -> &str {
            "http://fake"
        }
    }

    /// The index `policy` picks in `set` for a request with nothing prepared.
    pub(crate) fn pick(policy: &impl Policy, set: &Fake) -> Option<usize> {
        policy
            .pick(set, &PolicyInput::None)
            .ok()
            .map(|picked| picked.index)
    }

    /// How often each index is picked in `rounds` picks.
    pub(crate) fn histogram(policy: &impl Policy, set: &Fake, rounds: usize) -> Vec<usize> {
        let mut counts = vec![0; set.0.len()];
        for _ in 0..rounds {
            if let Some(i) = pick(policy, set) {
                counts[i] += 1;
            }
        }
        counts
    }
}

//! Load-balancing policies: pick one of a model's eligible instances.
//!
//! An instance is eligible when it is healthy, not ejected and not already
//! tried for this request. Policies see instances only through
//! [`CandidateSet`], so a KV-aware policy can later be added beside these
//! without touching the request path.

mod least_request;
mod power_of_two;
mod random;
mod round_robin;

use std::fmt;
use std::sync::Arc;

use kvmesh_config::PolicyKind;
use rand::Rng;

use crate::instance::Instance;

pub(crate) use least_request::LeastRequest;
pub(crate) use power_of_two::PowerOfTwo;
pub(crate) use random::Random;
pub(crate) use round_robin::RoundRobin;

/// What a policy may know about the instances it chooses from.
pub(crate) trait CandidateSet {
    /// Number of instances (eligible or not); indices run `0..len()`.
    fn len(&self) -> usize;
    /// Whether instance `index` may be picked.
    fn is_eligible(&self, index: usize) -> bool;
    /// Requests in flight on instance `index`.
    fn in_flight(&self, index: usize) -> u64;

    /// Number of eligible instances.
    fn eligible_count(&self) -> usize {
        (0..self.len()).filter(|&i| self.is_eligible(i)).count()
    }

    /// Index of the `n`-th eligible instance (0-based).
    fn nth_eligible(&self, n: usize) -> Option<usize> {
        (0..self.len()).filter(|&i| self.is_eligible(i)).nth(n)
    }
}

/// A load-balancing policy.
pub(crate) trait Policy: Send + Sync + fmt::Debug {
    /// The index of the chosen instance, or `None` when none is eligible.
    fn pick(&self, candidates: &dyn CandidateSet) -> Option<usize>;
}

/// The policy a model's config names; `None` for `kv`, which needs the request's
/// tokens and is built by [`crate::kv_route::KvRouter`].
pub(crate) fn build(kind: PolicyKind) -> Option<Box<dyn Policy>> {
    Some(match kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::Random => Box::new(Random),
        PolicyKind::LeastRequest => Box::new(LeastRequest),
        PolicyKind::PowerOfTwo => Box::new(PowerOfTwo),
        PolicyKind::Kv => return None,
    })
}

/// A uniformly random eligible instance.
fn random_eligible(candidates: &dyn CandidateSet, rng: &mut impl Rng) -> Option<usize> {
    let count = candidates.eligible_count();
    if count == 0 {
        return None;
    }
    candidates.nth_eligible(rng.gen_range(0..count))
}

/// Instances already tried for one request (a bit set; no allocation below 64).
#[derive(Debug, Default)]
pub(crate) struct Excluded {
    low: u64,
    high: Vec<u64>,
}

impl Excluded {
    /// Marks `index` as tried.
    pub(crate) fn insert(&mut self, index: usize) {
        if index < 64 {
            self.low |= 1 << index;
        } else {
            let word = index / 64 - 1;
            if self.high.len() <= word {
                self.high.resize(word + 1, 0);
            }
            self.high[word] |= 1 << (index % 64);
        }
    }

    /// Whether `index` was tried.
    pub(crate) fn contains(&self, index: usize) -> bool {
        if index < 64 {
            self.low & (1 << index) != 0
        } else {
            self.high
                .get(index / 64 - 1)
                .is_some_and(|word| word & (1 << (index % 64)) != 0)
        }
    }
}

/// A model's instances as seen by one pick: available and not yet tried.
pub(crate) struct Candidates<'a> {
    instances: &'a [Arc<Instance>],
    excluded: &'a Excluded,
    now_ms: u64,
}

impl<'a> Candidates<'a> {
    /// The candidates at clock time `now_ms`.
    pub(crate) fn new(instances: &'a [Arc<Instance>], excluded: &'a Excluded, now_ms: u64) -> Self {
        Self {
            instances,
            excluded,
            now_ms,
        }
    }
}

impl CandidateSet for Candidates<'_> {
    fn len(&self) -> usize {
        self.instances.len()
    }

    fn is_eligible(&self, index: usize) -> bool {
        !self.excluded.contains(index)
            && self
                .instances
                .get(index)
                .is_some_and(|instance| instance.is_available(self.now_ms))
    }

    fn in_flight(&self, index: usize) -> u64 {
        self.instances
            .get(index)
            .map_or(u64::MAX, |instance| instance.in_flight())
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    //! A fake candidate set for policy tests.

    use super::CandidateSet;

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
    }

    /// How often each index is picked in `rounds` picks.
    pub(crate) fn histogram(policy: &dyn super::Policy, set: &Fake, rounds: usize) -> Vec<usize> {
        let mut counts = vec![0; set.0.len()];
        for _ in 0..rounds {
            if let Some(i) = policy.pick(set) {
                counts[i] += 1;
            }
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::Fake;
    use super::*;

    #[test]
    fn excluded_is_a_set_of_any_size() {
        let mut excluded = Excluded::default();
        for i in [0, 5, 63, 64, 127, 128, 1000] {
            assert!(!excluded.contains(i));
            excluded.insert(i);
            assert!(excluded.contains(i));
        }
        assert!(!excluded.contains(1));
        assert!(!excluded.contains(65));
        assert!(!excluded.contains(999));
        assert!(!excluded.contains(5000));
    }

    #[test]
    fn kv_is_not_a_candidate_only_policy() {
        assert!(build(PolicyKind::Kv).is_none());
    }

    #[test]
    fn every_policy_returns_none_without_eligible_instances() {
        let set = Fake(vec![(false, 0), (false, 0)]);
        for kind in [
            PolicyKind::RoundRobin,
            PolicyKind::Random,
            PolicyKind::LeastRequest,
            PolicyKind::PowerOfTwo,
        ] {
            let policy = build(kind).unwrap();
            assert_eq!(policy.pick(&set), None, "{kind:?}");
            assert_eq!(policy.pick(&Fake(Vec::new())), None, "{kind:?}");
        }
    }

    #[test]
    fn every_policy_picks_only_eligible_instances() {
        let set = Fake(vec![
            (false, 0),
            (true, 9),
            (false, 0),
            (true, 3),
            (false, 0),
        ]);
        for kind in [
            PolicyKind::RoundRobin,
            PolicyKind::Random,
            PolicyKind::LeastRequest,
            PolicyKind::PowerOfTwo,
        ] {
            let policy = build(kind).unwrap();
            for _ in 0..200 {
                let picked = policy.pick(&set).unwrap();
                assert!(picked == 1 || picked == 3, "{kind:?} picked {picked}");
            }
        }
    }
}

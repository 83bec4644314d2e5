//! [`Balancer`]: the policy a model's config names, one of every [`Policy`] (static dispatch:
//! the request path matches on it instead of calling through a vtable).

use std::sync::Arc;
use std::time::Instant;

use kvmesh_config::PolicyKind;

use crate::candidates::{Candidate, CandidateSet};
use crate::kv::{Choice, Cost, KvRouter, Rejected, Steer};
use crate::policies::{LeastRequest, PowerOfTwo, Random, RoundRobin};
use crate::policy::{NoPick, Picked, Policy, PolicyInput};
use crate::prepare::{Prepared, Preparer};

/// How a model spreads requests over its instances.
#[derive(Debug)]
pub enum Balancer {
    /// `policy: round_robin`.
    RoundRobin(RoundRobin),
    /// `policy: random`.
    Random(Random),
    /// `policy: least_request`.
    LeastRequest(LeastRequest),
    /// `policy: power_of_two`.
    PowerOfTwo(PowerOfTwo),
    /// `policy: kv`, which looks at each request's prompt too.
    Kv(Box<KvRouter>),
}

impl Balancer {
    /// The policy `kind` names when it looks at the instances only; `None` for `kv`, which
    /// needs a [`KvRouter`] ([`Balancer::Kv`]).
    pub fn load_only(kind: PolicyKind) -> Option<Self> {
        Some(match kind {
            PolicyKind::RoundRobin => Self::RoundRobin(RoundRobin::default()),
            PolicyKind::Random => Self::Random(Random),
            PolicyKind::LeastRequest => Self::LeastRequest(LeastRequest),
            PolicyKind::PowerOfTwo => Self::PowerOfTwo(PowerOfTwo),
            PolicyKind::Kv => return None,
        })
    }

    /// The KV router (`policy: kv` only).
    #[inline]
    pub fn kv_router(&self) -> Option<&KvRouter> {
        match self {
            Self::Kv(router) => Some(router),
            _ => None,
        }
    }

    /// How a request's prompt is turned into blocks, when the policy wants it (`policy: kv`);
    /// `None`: nothing needs preparing ([`PolicyInput::None`]).
    #[inline]
    pub fn preparer(&self) -> Option<&Preparer> {
        self.kv_router().map(KvRouter::preparer)
    }

    /// The policy's input for a request of `session` whose prompt was `prepared` (looked up
    /// in the KV index at `now`, recording the stage timings and fallbacks).
    pub fn input(&self, prepared: &Prepared, session: Option<&str>, now: Instant) -> PolicyInput {
        match self.kv_router() {
            Some(router) => PolicyInput::Kv(router.request(prepared, now).in_session(session)),
            None => PolicyInput::None,
        }
    }

    /// Whether a request may wait for admission ([`Self::admit`]): only `policy: kv` has a
    /// queue; other policies admit at once, with no future to poll.
    #[inline]
    pub fn queues(&self) -> bool {
        self.kv_router().is_some()
    }

    /// Waits (bounded) while every instance is busy (`policy: kv`; other policies admit at
    /// once).
    pub async fn admit<C: Candidate>(
        &self,
        instances: &[Arc<C>],
        now_ms: impl Fn() -> u64,
    ) -> Result<(), Rejected> {
        match self.kv_router() {
            Some(router) => router.admit(instances, now_ms).await,
            None => Ok(()),
        }
    }

    /// The request header naming a request's session, when the policy binds sessions
    /// (`policy: kv` with `kv.session_header`).
    pub fn session_header(&self) -> Option<&str> {
        self.kv_router().and_then(KvRouter::session_header)
    }

    /// What the policy predicts for `input` on the instance of `candidates` it would choose
    /// now, booking and recording nothing; `None`: the policy predicts nothing (only
    /// `policy: kv` with a prompt does), or no instance is eligible and not busy.
    pub fn predict<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        input: &PolicyInput,
    ) -> Option<Cost> {
        let (Some(router), PolicyInput::Kv(request)) = (self.kv_router(), input) else {
            return None;
        };
        match router.choose(candidates, request, &mut rand::thread_rng()) {
            Choice::Picked(decision) => Some(decision.cost),
            Choice::AllBusy | Choice::NoneEligible => None,
        }
    }

    /// [`Policy::pick`], taking the instance the model's decider chose (`steer`, `policy:
    /// kv` only) when it may.
    pub fn pick_steered<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        input: &PolicyInput,
        steer: Option<Steer>,
    ) -> Result<Picked<'_>, NoPick> {
        match (self, steer) {
            (Self::Kv(router), Some(_)) => router.pick_steered(candidates, input, steer),
            _ => self.pick(candidates, input),
        }
    }

    /// Instance `id` joined the pool.
    pub fn add_instance(&self, id: u64) {
        if let Some(router) = self.kv_router() {
            router.add_instance(id);
        }
    }

    /// Instance `id` left the pool.
    pub fn remove_instance(&self, id: u64) {
        if let Some(router) = self.kv_router() {
            router.remove_instance(id);
        }
    }

    /// The instance of `candidates` that [`pick`](Policy::pick) would choose for `input`
    /// now, booking and recording nothing (`None`: none eligible, or every one busy). The
    /// endpoint picker names its fallbacks this way. Round robin moves on as a pick does.
    pub fn peek<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        input: &PolicyInput,
    ) -> Option<usize> {
        match self {
            Self::Kv(router) => router.peek(candidates, input),
            _ => self.pick(candidates, input).ok().map(|picked| picked.index),
        }
    }

    /// Copies live routing state of `instances` into the gauges (called before a scrape).
    pub fn refresh_gauges<C: Candidate>(&self, instances: &[Arc<C>]) {
        if let Some(router) = self.kv_router() {
            router.refresh_gauges(instances);
        }
    }
}

impl Policy for Balancer {
    #[inline]
    fn pick<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        input: &PolicyInput,
    ) -> Result<Picked<'_>, NoPick> {
        match self {
            Self::RoundRobin(policy) => policy.pick(candidates, input),
            Self::Random(policy) => policy.pick(candidates, input),
            Self::LeastRequest(policy) => policy.pick(candidates, input),
            Self::PowerOfTwo(policy) => policy.pick(candidates, input),
            Self::Kv(router) => router.pick(candidates, input),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_support::{Fake, pick};

    const LOAD_ONLY: [PolicyKind; 4] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastRequest,
        PolicyKind::PowerOfTwo,
    ];

    #[test]
    fn kv_is_not_a_load_only_policy() {
        assert!(Balancer::load_only(PolicyKind::Kv).is_none());
    }

    #[test]
    fn every_policy_returns_none_without_eligible_instances() {
        let set = Fake(vec![(false, 0), (false, 0)]);
        for kind in LOAD_ONLY {
            let policy = Balancer::load_only(kind).unwrap();
            assert_eq!(pick(&policy, &set), None, "{kind:?}");
            assert_eq!(pick(&policy, &Fake(Vec::new())), None, "{kind:?}");
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
        for kind in LOAD_ONLY {
            let policy = Balancer::load_only(kind).unwrap();
            for _ in 0..200 {
                let picked = pick(&policy, &set).unwrap();
                assert!(picked == 1 || picked == 3, "{kind:?} picked {picked}");
            }
        }
    }
}

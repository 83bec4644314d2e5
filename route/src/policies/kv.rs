//! `policy: kv`: the [`KvRouter`] behind the [`Policy`] trait. It chooses by cached prefix
//! and load ([`KvRouter::choose`]), books the request's load on the chosen instance
//! ([`KvRouter::commit`]) and explains the choice (`x-kvmesh-route`).

use std::time::Instant;

use crate::candidates::CandidateSet;
use crate::kv::{Choice, KvRequest, KvRouter, Steer, route_header_noting};
use crate::policy::{NoPick, Picked, Policy, PolicyInput};

impl KvRouter {
    /// The instance [`pick`](Policy::pick) would choose for `input` now, without booking
    /// or recording it.
    pub fn peek<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        input: &PolicyInput,
    ) -> Option<usize> {
        with_request(input, |request| {
            match self.choose(candidates, request, &mut rand::thread_rng()) {
                Choice::Picked(decision) => Some(decision.index),
                Choice::AllBusy | Choice::NoneEligible => None,
            }
        })
    }

    /// [`Policy::pick`], taking the instance the model's decider chose (`steer`) when it
    /// is an eligible candidate that is not busy here.
    pub fn pick_steered<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        input: &PolicyInput,
        steer: Option<Steer>,
    ) -> Result<Picked<'_>, NoPick> {
        with_request(input, |request| self.pick_for(candidates, request, steer))
    }

    /// Chooses for `request` (the instance `steer` names, when it may) and books the choice.
    fn pick_for<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        request: &KvRequest,
        steer: Option<Steer>,
    ) -> Result<Picked<'_>, NoPick> {
        match self.choose_steered(candidates, request, steer, &mut rand::thread_rng()) {
            Choice::Picked(decision) => {
                let booking = self.commit(&decision, request, Instant::now());
                Ok(Picked {
                    index: decision.index,
                    dp_rank: decision.dp_rank,
                    booking: Some(booking),
                    explanation: Some(route_header_noting(
                        candidates.url(decision.index),
                        &decision,
                        request,
                        self.block_size_conflict(decision.instance_id),
                        self.tokenizer_checks()
                            .mismatch(decision.instance_id)
                            .map(|mismatch| mismatch.probe),
                    )),
                })
            }
            Choice::AllBusy => {
                self.count_busy_rejection();
                Err(NoPick::Busy)
            }
            Choice::NoneEligible => Err(NoPick::Nothing),
        }
    }
}

impl Policy for KvRouter {
    /// Chooses for the request's prompt (a request with [`PolicyInput::None`] is routed by
    /// load alone); answers [`NoPick::Busy`] when every eligible instance is busy.
    fn pick<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        input: &PolicyInput,
    ) -> Result<Picked<'_>, NoPick> {
        with_request(input, |request| self.pick_for(candidates, request, None))
    }
}

/// Calls `f` with `input`'s request (one without a prompt for [`PolicyInput::None`]: routed
/// by load alone).
fn with_request<R>(input: &PolicyInput, f: impl FnOnce(&KvRequest) -> R) -> R {
    match input {
        PolicyInput::Kv(request) => f(request),
        PolicyInput::None => f(&KvRequest::without_prompt()),
    }
}

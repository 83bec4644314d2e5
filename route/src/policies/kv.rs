//! `policy: kv`: the [`KvRouter`] behind the [`Policy`] trait. It chooses by cached prefix
//! and load ([`KvRouter::choose`]), books the request's load on the chosen instance
//! ([`KvRouter::commit`]) and explains the choice (`x-kvmesh-route`).

use std::time::Instant;

use crate::candidates::CandidateSet;
use crate::kv::{Choice, KvRequest, KvRouter, route_header};
use crate::policy::{NoPick, Picked, Policy, PolicyInput};

impl Policy for KvRouter {
    /// Chooses for the request's prompt (a request with [`PolicyInput::None`] is routed by
    /// load alone); answers [`NoPick::Busy`] when every eligible instance is busy.
    fn pick<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        input: &PolicyInput,
    ) -> Result<Picked<'_>, NoPick> {
        let unprepared;
        let request = match input {
            PolicyInput::Kv(request) => request,
            PolicyInput::None => {
                unprepared = KvRequest::without_prompt();
                &unprepared
            }
        };
        match self.choose(candidates, request, &mut rand::thread_rng()) {
            Choice::Picked(decision) => {
                let booking = self.commit(&decision, request, Instant::now());
                Ok(Picked {
                    index: decision.index,
                    booking: Some(booking),
                    explanation: Some(route_header(
                        candidates.url(decision.index),
                        &decision,
                        request,
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

//! The prefill leg of a disaggregated model (phase 3a of [`crate::request`]): the model's
//! engine protocol ([`crate::engines::protocol`], `disaggregation.protocol`) builds the
//! prefill leg from the client's request; it goes to a prefill instance chosen by the
//! model's policy, attempt by attempt the spine's way (traced, judged, failed over and
//! retried within `limits.retries` and the retry budget). vLLM's protocol joins the answer
//! into the decode leg, which the spine then sends to a decode instance as it sends any
//! request. SGLang's sends both legs at once: once the prefill leg is written (a connect
//! failure fails over like any attempt), the spine sends the decode leg, and the prefill
//! leg's answer is read and judged after the decode leg's ([`PendingPrefill::finish`]).
//!
//! Whether a request prefills remotely at all is a routing decision
//! ([`kvmesh_route::prefills_locally`]): with `mode: conditional` it stays on the decode
//! instance when the part of the prompt that instance does not cache is shorter than
//! `min_remote_prefill_tokens`. A failed prefill leg (no prefill instance left, an error, an
//! answer the protocol cannot use) serves the request whole on the decode instance, or
//! answers 503 with `on_prefill_failure: fail`.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;
use kvmesh_config::{DisaggregationConfig, PrefillFailure};
use kvmesh_route::kv::Booking;
use kvmesh_route::{CandidateSet, Candidates, Excluded, NoPick, prefills_locally};
use serde_json::{Map, Value};
use tokio::time::timeout;

use crate::engines::clock::now_millis;
use crate::engines::instance::{InFlight, Instance};
use crate::engines::pool::ModelPool;
use crate::engines::protocol::sglang::{self, Bootstrap};
use crate::engines::protocol::{self as engine_protocol, Legs, vllm};
use crate::engines::upstream::SentLeg;
use crate::engines::upstream_session::UpstreamSession;
use crate::metrics::failure::FailureKind;
use crate::metrics::families::PrefillLeg;
use crate::openai::api_error::ApiError;
use crate::openai::route::Route;
use crate::request::attempt::{Failover, attempt, send_leg};
use crate::request::frontend::Frontend;
use crate::request::pick::{pick, prefill_only, steer};
use crate::request::prepare::Picker;
use crate::request::record::Record;
use crate::request::respond::judge;
use crate::request::stop::Stop;
use crate::request::trace::RequestTrace;
use crate::state::shared::State;

/// Where a request of a disaggregated model prefills.
pub(crate) enum Prefilled<'a> {
    /// On its decode instance; why (for the explanation).
    Local(String),
    /// On `instance`; `body` is the decode leg's (vLLM's: carrying the prefill's
    /// `kv_transfer_params`; SGLang's: its bootstrap room).
    Remote {
        /// The prefill instance.
        instance: Arc<Instance>,
        /// The decode leg's body.
        body: Bytes,
        /// The prefill leg still to answer (SGLang's).
        pending: Option<PendingPrefill<'a>>,
    },
}

/// A prefill leg sent beside its decode leg, whose answer is read once the decode leg's is.
pub(crate) struct PendingPrefill<'a> {
    leg: SentLeg,
    instance: &'a Instance,
    booking: Option<Booking<'a>>,
    _in_flight: InFlight<'a>,
}

impl PendingPrefill<'_> {
    /// Reads and judges the prefill leg's answer (a 5xx counts towards the instance's
    /// ejection), releases its booking and connection, and counts the leg in `pool`'s
    /// metrics as remote or failed.
    pub(crate) async fn finish(self, state: &State, pool: &ModelPool) {
        let instance = self.instance;
        if let Some(booking) = &self.booking {
            booking.prefill_done(false);
        }
        let head = timeout(state.limits.first_byte_timeout, self.leg.answer()).await;
        let outcome = match head {
            Err(_) => {
                instance.record_failure(FailureKind::Timeout, &state.outlier, now_millis());
                Err(format!("{}: no answer in time", instance.url()))
            }
            Ok(Err((kind, error))) => {
                instance.record_failure(kind, &state.outlier, now_millis());
                Err(format!("{}: {error}", instance.url()))
            }
            Ok(Ok(answer)) => match judge(state, instance, &answer) {
                None => Err(format!("{}: no status", instance.url())),
                Some(_) => read_answer(state, instance, answer)
                    .await
                    .map(drop)
                    .map_err(|error| match error {
                        LegError::Failed(detail) => detail,
                        LegError::ClientGone => "the client left".to_string(),
                    }),
            },
        };
        match outcome {
            Ok(()) => pool.metrics().prefill_leg(PrefillLeg::Remote),
            Err(detail) => {
                pool.metrics().prefill_leg(PrefillLeg::Failed);
                tracing::warn!(model = pool.name(), %detail, "prefill leg failed");
            }
        }
    }
}

impl Prefilled<'_> {
    /// The prefill leg still to answer, taken.
    pub(crate) fn take_pending(&mut self) -> Option<PendingPrefill<'_>> {
        match self {
            Self::Remote { pending, .. } => pending.take(),
            Self::Local(_) => None,
        }
    }

    /// The explanation's prefix naming the prefill leg.
    pub(crate) fn explain(&self) -> String {
        match self {
            Self::Local(why) => format!("prefill=local ({why}); "),
            Self::Remote { instance, .. } => format!("prefill={}; ", instance.url()),
        }
    }
}

/// Runs the prefill leg of `record`'s request (its `body`) to `pool`, a disaggregated model
/// (`config`), when the model's mode asks for one.
pub(crate) async fn prefill<'a, F: Frontend>(
    state: &State,
    frontend: &mut F,
    (pool, config): (&ModelPool, &DisaggregationConfig),
    instances: &'a [Arc<Instance>],
    picker: &Picker<'a>,
    body: &Bytes,
    (record, trace): (&Record, &mut RequestTrace),
) -> Result<Prefilled<'a>, Stop> {
    let metrics = pool.metrics();
    let route = record.route.unwrap_or(Route::ChatCompletions);
    let decode_excluded = prefill_only(instances);
    let decoders = Candidates::new(instances, &decode_excluded, now_millis());
    let generates = match route {
        Route::ChatCompletions | Route::Completions => true,
        Route::Engine(engine) => engine.generates(),
        _ => false,
    };
    let local = prefills_locally(
        picker.balancer,
        config,
        (generates, route.label()),
        &decoders,
        &picker.input,
    );
    let now = now_millis();
    let not_prefilling = match local {
        Some(why) => Err(why),
        None => prefill_exclusions(
            &decoders,
            |at| instances[at].role().prefills(),
            |at| instances[at].is_available(now),
        ),
    };
    let not_prefilling = match not_prefilling {
        Ok(excluded) => excluded,
        Err(why) => {
            metrics.prefill_leg(PrefillLeg::Local);
            return Ok(Prefilled::Local(why));
        }
    };
    let request = (&record.request_id, trace);
    let picks = (picker, not_prefilling);
    let remote = match engine_protocol::legs(config.protocol) {
        Legs::Sequential => {
            sequential(state, frontend, pool, instances, picks, body, request).await
        }
        Legs::Concurrent => {
            concurrent(state, frontend, pool, instances, picks, body, request).await
        }
    };
    match remote {
        Ok(prefilled) => {
            // A pending leg is counted once it answered.
            if !matches!(
                prefilled,
                Prefilled::Remote {
                    pending: Some(_),
                    ..
                }
            ) {
                metrics.prefill_leg(PrefillLeg::Remote);
            }
            Ok(prefilled)
        }
        Err(LegError::ClientGone) => Err(Stop::ClientGone),
        Err(LegError::Failed(detail)) => {
            metrics.prefill_leg(PrefillLeg::Failed);
            tracing::warn!(model = pool.name(), %detail, "prefill leg failed");
            match config.on_prefill_failure {
                PrefillFailure::Aggregated => {
                    Ok(Prefilled::Local(format!("prefill leg failed: {detail}")))
                }
                PrefillFailure::Fail => Err(Stop::Answer(ApiError::PrefillFailed {
                    model: pool.name().to_string(),
                    detail,
                })),
            }
        }
    }
}

/// The instances a prefill leg may not go to: those that do not prefill, and the one
/// instance that can take the decode leg when there is only one (the decode leg never goes
/// where the prefill leg went: a `both` instance whose peers are down would prefill for
/// nobody). `Err` (why) when that leaves no available prefill instance: the request then
/// prefills where it decodes. `decoders` are the instances that may take the decode leg;
/// `prefills` and `available` say so of instance `at`.
fn prefill_exclusions(
    decoders: &impl CandidateSet,
    prefills: impl Fn(usize) -> bool,
    available: impl Fn(usize) -> bool,
) -> Result<Excluded, String> {
    let mut excluded = Excluded::default();
    for at in (0..decoders.len()).filter(|&at| !prefills(at)) {
        excluded.insert(at);
    }
    let sole_decoder = (decoders.eligible_count() == 1)
        .then(|| decoders.nth_eligible(0))
        .flatten()
        .filter(|&at| prefills(at));
    if let Some(only) = sole_decoder {
        excluded.insert(only);
        let others = (0..decoders.len()).any(|at| !excluded.contains(at) && available(at));
        if !others {
            return Err(
                "the only instance that can decode is the only prefill instance".to_string(),
            );
        }
    }
    Ok(excluded)
}

/// Why a prefill leg did not prefill.
enum LegError {
    /// The client went away.
    ClientGone,
    /// Anything else, said.
    Failed(String),
}

impl From<Stop> for LegError {
    fn from(stop: Stop) -> Self {
        match stop {
            Stop::ClientGone => Self::ClientGone,
            Stop::Answer(error) => Self::Failed(error.message()),
        }
    }
}

/// The client's request body as a JSON object.
fn request_object(body: &Bytes) -> Result<Map<String, Value>, LegError> {
    serde_json::from_slice(body)
        .map_err(|error| LegError::Failed(format!("the body is not a JSON object: {error}")))
}

/// Sends both legs' body (SGLang's: the request with a bootstrap room on the prefill
/// instance) to a prefill instance, without waiting for its answer, which comes once the
/// decode leg has joined the room. A failure to send fails over to another prefill
/// instance, as an attempt of the spine does.
async fn concurrent<'a, F: Frontend>(
    state: &State,
    frontend: &mut F,
    pool: &ModelPool,
    instances: &'a [Arc<Instance>],
    (picker, not_prefilling): (&Picker<'a>, Excluded),
    body: &Bytes,
    (request_id, trace): (&HeaderValue, &mut RequestTrace),
) -> Result<Prefilled<'a>, LegError> {
    let request = request_object(body)?;
    let mut failover = Failover::for_leg(state);
    failover.excluded = not_prefilling;
    loop {
        let steer = steer(instances, picker, &failover.excluded).await;
        let picked = match pick(instances, picker, &failover.excluded, steer) {
            Ok(picked) => picked,
            Err(why) => return Err(no_prefill_instance(state, pool, &mut failover, why)),
        };
        let instance = &*instances[picked.index];
        let bootstrap = Bootstrap::new(instance.url().host(), instance.bootstrap_port());
        let leg = sglang::leg(&request, &bootstrap).map_err(LegError::Failed)?;
        let in_flight = instance.start_request();
        let engine_trace = trace.attempt(instance);
        match send_leg(state, frontend, &picked, &leg, request_id, engine_trace).await {
            Ok(sent) => {
                return Ok(Prefilled::Remote {
                    instance: Arc::clone(&picked.instance),
                    body: leg,
                    pending: Some(PendingPrefill {
                        leg: sent,
                        instance,
                        booking: picked.booking,
                        _in_flight: in_flight,
                    }),
                });
            }
            Err(error) => {
                drop(in_flight);
                trace.attempt_failed(&error);
                failover.failed(state, pool, instances, &picked, error)?;
                failover.backoff(frontend).await?;
            }
        }
    }
}

/// Why no prefill instance is left for the leg.
fn no_prefill_instance(
    state: &State,
    pool: &ModelPool,
    failover: &mut Failover,
    why: NoPick,
) -> LegError {
    LegError::Failed(match failover.exhausted(state, pool, why) {
        ApiError::UpstreamUnavailable { detail } => detail,
        _ => format!("no prefill instance ({why:?})"),
    })
}

/// Sends vLLM's prefill leg to a prefill instance and builds the decode leg's body from its
/// answer. Each attempt goes the spine's way: traced, judged (a 5xx counts towards the
/// instance's ejection), failed over to another prefill instance (a connect failure, a
/// stale pooled connection, a retryable status or a first-byte timeout) within
/// `limits.retries` and the model's retry budget.
async fn sequential<'a, F: Frontend>(
    state: &State,
    frontend: &mut F,
    pool: &ModelPool,
    instances: &'a [Arc<Instance>],
    (picker, not_prefilling): (&Picker<'a>, Excluded),
    body: &Bytes,
    (request_id, trace): (&HeaderValue, &mut RequestTrace),
) -> Result<Prefilled<'a>, LegError> {
    let request = request_object(body)?;
    let leg = vllm::prefill_leg(&request).map_err(LegError::Failed)?;
    let mut failover = Failover::for_leg(state);
    failover.excluded = not_prefilling;
    loop {
        let steer = steer(instances, picker, &failover.excluded).await;
        let picked = match pick(instances, picker, &failover.excluded, steer) {
            Ok(picked) => picked,
            Err(why) => return Err(no_prefill_instance(state, pool, &mut failover, why)),
        };
        let instance = Arc::clone(&picked.instance);
        let in_flight = instance.start_request();
        let engine_trace = trace.attempt(&instance);
        let answer = match attempt(
            state,
            frontend,
            &picked,
            (&leg, None),
            request_id,
            engine_trace,
        )
        .await
        {
            Ok(answer) => answer,
            Err(error) => {
                drop(in_flight);
                trace.attempt_failed(&error);
                failover.failed(state, pool, instances, &picked, error)?;
                failover.backoff(frontend).await?;
                continue;
            }
        };
        let Some(status) = judge(state, &instance, &answer) else {
            return Err(LegError::Failed(format!("{}: no status", instance.url())));
        };
        trace.answered(status);
        if failover.retries_status(state, pool, instances, &picked, status) {
            drop((answer, in_flight));
            trace.retried();
            failover.backoff(frontend).await?;
            continue;
        }
        if let Some(booking) = &picked.booking {
            booking.prefill_done(false);
        }
        let answer = read_answer(state, &instance, answer).await?;
        drop(in_flight);
        let body = vllm::decode_leg(request, &answer)
            .map_err(|error| LegError::Failed(format!("{}: {error}", instance.url())))?;
        return Ok(Prefilled::Remote {
            instance,
            body,
            pending: None,
        });
    }
}

/// Reads the prefill instance's whole answer, a 200 (anything else is a failed leg); the
/// connection goes back to the pool.
async fn read_answer(
    state: &State,
    instance: &Instance,
    mut answer: UpstreamSession,
) -> Result<Vec<u8>, LegError> {
    let status = answer.status().unwrap_or(0);
    let limit = usize::try_from(state.limits.max_body_bytes).unwrap_or(usize::MAX);
    let mut bytes = Vec::new();
    loop {
        let piece = match answer.take_buffered() {
            Some(piece) => piece,
            None => answer
                .read_body_within(state.limits.idle_timeout)
                .await
                .map_err(|_| LegError::Failed(format!("{}: answer too slow", instance.url())))?,
        };
        match piece {
            Ok(Some(piece)) => {
                if bytes.len() + piece.len() > limit {
                    return Err(LegError::Failed(format!(
                        "{}: answer too large",
                        instance.url()
                    )));
                }
                bytes.extend_from_slice(&piece);
            }
            Ok(None) => break,
            Err(error) => {
                instance.record_failure(FailureKind::Reset, &state.outlier, now_millis());
                return Err(LegError::Failed(format!("{}: {error}", instance.url())));
            }
        }
    }
    state.upstream.release(answer, instance.peer()).await;
    if status != 200 {
        let text = String::from_utf8_lossy(&bytes);
        return Err(LegError::Failed(format!(
            "{} answered {status}: {}",
            instance.url(),
            text.chars().take(200).collect::<String>()
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Instances as (available, decodes) pairs, all eligible for the decode pick when
    /// available and decoding.
    struct Fleet(Vec<(bool, bool)>);

    impl CandidateSet for Fleet {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn is_eligible(&self, index: usize) -> bool {
            self.0[index] == (true, true)
        }
        fn in_flight(&self, _: usize) -> u64 {
            0
        }
        fn id(&self, index: usize) -> u64 {
            index as u64
        }
        fn url(&self, _: usize) -> &str {
            ""
        }
    }

    fn exclusions(fleet: &[(bool, bool, bool)]) -> Result<Vec<usize>, String> {
        let decoders = Fleet(
            fleet
                .iter()
                .map(|&(up, _, decodes)| (up, decodes))
                .collect(),
        );
        let excluded = prefill_exclusions(&decoders, |at| fleet[at].1, |at| fleet[at].0)?;
        Ok((0..fleet.len())
            .filter(|&at| excluded.contains(at))
            .collect())
    }

    // (available, prefills, decodes)
    const BOTH_UP: (bool, bool, bool) = (true, true, true);
    const BOTH_DOWN: (bool, bool, bool) = (false, true, true);
    const PREFILL_UP: (bool, bool, bool) = (true, true, false);
    const PREFILL_DOWN: (bool, bool, bool) = (false, true, false);
    const DECODE_UP: (bool, bool, bool) = (true, false, true);

    #[test]
    fn the_only_instance_left_that_decodes_does_not_prefill_for_itself() {
        // Two `both` instances, one down: the live one would prefill, then nothing is
        // left for the decode leg (it never goes where the prefill went): it prefills and
        // decodes the request itself.
        assert_eq!(
            exclusions(&[BOTH_UP, BOTH_DOWN]),
            Err("the only instance that can decode is the only prefill instance".to_string())
        );
        // With a prefill instance beside it, that one prefills.
        assert_eq!(exclusions(&[BOTH_UP, PREFILL_UP]), Ok(vec![0]));
        assert_eq!(
            exclusions(&[BOTH_UP, PREFILL_DOWN]),
            Err("the only instance that can decode is the only prefill instance".to_string())
        );
    }

    #[test]
    fn otherwise_only_instances_that_do_not_prefill_are_left_out() {
        assert_eq!(exclusions(&[BOTH_UP, BOTH_UP]), Ok(vec![]));
        assert_eq!(exclusions(&[PREFILL_UP, DECODE_UP]), Ok(vec![1]));
        // A decode-only instance alone: the prefill instances are judged as before (none
        // up is a failed prefill leg, as `on_prefill_failure` says).
        assert_eq!(exclusions(&[PREFILL_DOWN, DECODE_UP]), Ok(vec![1]));
    }
}

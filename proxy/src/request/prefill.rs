//! The prefill leg of a disaggregated model (phase 3a of [`crate::request`]): the model's
//! engine protocol ([`crate::engines::protocol`], `disaggregation.protocol`) builds the
//! prefill leg from the client's request; it goes to a prefill instance chosen by the
//! model's policy, attempt by attempt the spine's way (traced, judged, failed over and
//! retried within `limits.retries` and the retry budget); the protocol joins the answer
//! into the decode leg, which the spine then sends to a decode instance as it sends any
//! request.
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
use kvmesh_config::{DisaggregationConfig, DisaggregationProtocol, PrefillFailure};
use kvmesh_route::{CandidateSet, Candidates, Excluded, prefills_locally};
use serde_json::{Map, Value};

use crate::engines::clock::now_millis;
use crate::engines::instance::Instance;
use crate::engines::pool::ModelPool;
use crate::engines::protocol::{self as engine_protocol, Legs};
use crate::engines::upstream_session::UpstreamSession;
use crate::metrics::failure::FailureKind;
use crate::metrics::families::PrefillLeg;
use crate::openai::api_error::ApiError;
use crate::openai::route::Route;
use crate::request::attempt::{Failover, attempt};
use crate::request::frontend::Frontend;
use crate::request::pick::{pick, prefill_only};
use crate::request::prepare::Picker;
use crate::request::record::Record;
use crate::request::respond::judge;
use crate::request::stop::Stop;
use crate::request::trace::RequestTrace;
use crate::state::shared::State;

/// Where a request of a disaggregated model prefills.
#[derive(Debug)]
pub(crate) enum Prefilled {
    /// On its decode instance; why (for the explanation).
    Local(String),
    /// On `instance`; `body` is the decode leg's, carrying the prefill's
    /// `kv_transfer_params`.
    Remote {
        /// The prefill instance.
        instance: Arc<Instance>,
        /// The decode leg's body.
        body: Bytes,
    },
}

impl Prefilled {
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
pub(crate) async fn prefill<F: Frontend>(
    state: &State,
    frontend: &mut F,
    (pool, config): (&ModelPool, &DisaggregationConfig),
    instances: &[Arc<Instance>],
    picker: &Picker<'_>,
    body: &Bytes,
    (record, trace): (&Record, &mut RequestTrace),
) -> Result<Prefilled, Stop> {
    let metrics = pool.metrics();
    let route = record.route.unwrap_or(Route::ChatCompletions);
    let decode_excluded = prefill_only(instances);
    let decoders = Candidates::new(instances, &decode_excluded, now_millis());
    let generates = matches!(route, Route::ChatCompletions | Route::Completions);
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
    let remote = match engine_protocol::legs(config.protocol) {
        Legs::Sequential => {
            let model = (pool, config.protocol);
            let request = (&record.request_id, trace);
            let picks = (picker, not_prefilling);
            remote(state, frontend, model, instances, picks, body, request).await
        }
    };
    match remote {
        Ok(prefilled) => {
            metrics.prefill_leg(PrefillLeg::Remote);
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

/// Sends the prefill leg to a prefill instance and builds the decode leg's body. Each
/// attempt goes the spine's way: traced, judged (a 5xx counts towards the instance's
/// ejection), failed over to another prefill instance (a connect failure, a stale pooled
/// connection, a retryable status or a first-byte timeout) within `limits.retries` and the
/// model's retry budget.
async fn remote<F: Frontend>(
    state: &State,
    frontend: &mut F,
    (pool, protocol): (&ModelPool, DisaggregationProtocol),
    instances: &[Arc<Instance>],
    (picker, not_prefilling): (&Picker<'_>, Excluded),
    body: &Bytes,
    (request_id, trace): (&HeaderValue, &mut RequestTrace),
) -> Result<Prefilled, LegError> {
    let request: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|error| LegError::Failed(format!("the body is not a JSON object: {error}")))?;
    let leg = engine_protocol::prefill_leg(protocol, &request).map_err(LegError::Failed)?;
    let mut failover = Failover::for_leg(state);
    failover.excluded = not_prefilling;
    loop {
        let picked = match pick(instances, picker, &failover.excluded) {
            Ok(picked) => picked,
            Err(why) => {
                return Err(LegError::Failed(
                    match failover.exhausted(state, pool, why) {
                        ApiError::UpstreamUnavailable { detail } => detail,
                        _ => format!("no prefill instance ({why:?})"),
                    },
                ));
            }
        };
        let instance = Arc::clone(&picked.instance);
        let in_flight = instance.start_request();
        let engine_trace = trace.attempt(&instance);
        let answer = match attempt(state, frontend, &instance, &leg, request_id, engine_trace).await
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
        let body = engine_protocol::decode_leg(protocol, request, &answer)
            .map_err(|error| LegError::Failed(format!("{}: {error}", instance.url())))?;
        return Ok(Prefilled::Remote { instance, body });
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

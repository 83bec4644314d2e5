//! The prefill leg of a disaggregated model (phase 4a of [`crate::request`]), in vLLM's
//! NixlConnector protocol as its own disaggregation proxy speaks it: the client's request
//! with `kv_transfer_params.do_remote_decode`, `stream: false` and one token goes to a
//! prefill instance chosen by the model's KV policy; the `kv_transfer_params` of its JSON
//! answer go into the client's request, which the spine then sends to a decode instance
//! (the decode leg) as it sends any request.
//!
//! With `mode: conditional` the prefill stays on the decode instance when the part of the
//! prompt the decode instance the policy would choose does not cache is shorter than
//! `min_remote_prefill_tokens`. A failed prefill leg (no prefill instance, an error, an answer
//! without `kv_transfer_params`) serves the request whole on the decode instance, or answers
//! 503 with `on_prefill_failure: fail`.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;
use kvmesh_config::{DisaggregationConfig, PrefillFailure};
use kvmesh_route::{Candidates, Excluded, prefills_locally};
use serde_json::{Map, Value, json};

use crate::api_error::ApiError;
use crate::clock::now_millis;
use crate::instance::Instance;
use crate::metrics::PrefillLeg;
use crate::pool::ModelPool;
use crate::request::attempt::{AttemptError, attempt};
use crate::request::frontend::Frontend;
use crate::request::pick::pick;
use crate::request::prepare::Picker;
use crate::request::record::Record;
use crate::request::stop::Stop;
use crate::route::Route;
use crate::state::State;

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

/// The instances that take no decode legs (prefill only), excluded from a disaggregated
/// model's decode picks.
pub(crate) fn prefill_only(instances: &[Arc<Instance>]) -> Excluded {
    Excluded::matching(instances, |instance| !instance.role().decodes())
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
    record: &Record,
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
    if let Some(why) = local {
        metrics.prefill_leg(PrefillLeg::Local);
        return Ok(Prefilled::Local(why));
    }
    match remote(state, frontend, instances, picker, body, &record.request_id).await {
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

/// Why a prefill leg did not prefill.
enum LegError {
    /// The client went away.
    ClientGone,
    /// Anything else, said.
    Failed(String),
}

/// Picks a prefill instance, sends it the prefill leg and builds the decode leg's body.
async fn remote<F: Frontend>(
    state: &State,
    frontend: &mut F,
    instances: &[Arc<Instance>],
    picker: &Picker<'_>,
    body: &Bytes,
    request_id: &HeaderValue,
) -> Result<Prefilled, LegError> {
    let mut request: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|error| LegError::Failed(format!("the body is not a JSON object: {error}")))?;
    let not_prefilling = Excluded::matching(instances, |instance| !instance.role().prefills());
    let picked = pick(instances, picker, &not_prefilling)
        .map_err(|why| LegError::Failed(format!("no prefill instance ({why:?})")))?;
    let instance = Arc::clone(&picked.instance);
    let leg = Bytes::from(
        serde_json::to_vec(&prefill_request(&request))
            .map_err(|error| LegError::Failed(error.to_string()))?,
    );
    let in_flight = instance.start_request();
    let answer = match attempt(state, frontend, &instance, &leg, request_id, None).await {
        Ok(engine) => engine,
        Err(AttemptError::ClientGone) => return Err(LegError::ClientGone),
        Err(AttemptError::Retryable { kind, detail, .. }) => {
            instance.record_failure(kind, &state.outlier, now_millis());
            return Err(LegError::Failed(detail));
        }
        Err(AttemptError::Timeout) => {
            return Err(LegError::Failed(format!(
                "{}: no response head in time",
                instance.url()
            )));
        }
        Err(AttemptError::Unforwardable(detail)) => return Err(LegError::Failed(detail)),
    };
    if let Some(booking) = &picked.booking {
        booking.prefill_done(false);
    }
    let params = read_params(state, &instance, answer).await?;
    drop(in_flight);
    request.insert("kv_transfer_params".to_string(), params);
    let body = serde_json::to_vec(&request).map_err(|error| LegError::Failed(error.to_string()))?;
    Ok(Prefilled::Remote {
        instance,
        body: Bytes::from(body),
    })
}

/// The prefill leg of the client's `request`, as vLLM's disaggregation proxy builds it.
fn prefill_request(request: &Map<String, Value>) -> Map<String, Value> {
    let mut leg = request.clone();
    leg.insert(
        "kv_transfer_params".to_string(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    leg.insert("stream".to_string(), Value::Bool(false));
    leg.insert("max_tokens".to_string(), json!(1));
    if leg.contains_key("max_completion_tokens") {
        leg.insert("max_completion_tokens".to_string(), json!(1));
    }
    for field in ["stream_options", "min_tokens", "min_completion_tokens"] {
        leg.remove(field);
    }
    leg
}

/// Reads the prefill instance's whole answer and takes its `kv_transfer_params`; the
/// connection goes back to the pool.
async fn read_params(
    state: &State,
    instance: &Instance,
    mut answer: crate::upstream_session::UpstreamSession,
) -> Result<Value, LegError> {
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
    let mut answer: Map<String, Value> = serde_json::from_slice(&bytes).map_err(|error| {
        LegError::Failed(format!(
            "{}: the answer is not JSON: {error}",
            instance.url()
        ))
    })?;
    match answer.remove("kv_transfer_params") {
        Some(params @ Value::Object(_)) => Ok(params),
        _ => Err(LegError::Failed(format!(
            "{}: the answer carries no kv_transfer_params (is the engine started with a \
             KV connector?)",
            instance.url()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_leg_is_the_request_with_one_token_no_stream_and_the_params() {
        let request: Map<String, Value> = serde_json::from_str(
            r#"{"model":"m","prompt":"hi","max_tokens":50,"stream":true,
                "stream_options":{"include_usage":true},"min_tokens":4,"temperature":0.5}"#,
        )
        .unwrap();
        let leg = prefill_request(&request);
        assert_eq!(leg["max_tokens"], 1);
        assert_eq!(leg["stream"], false);
        assert_eq!(leg["temperature"], 0.5);
        assert_eq!(leg["prompt"], "hi");
        for gone in ["stream_options", "min_tokens", "min_completion_tokens"] {
            assert!(!leg.contains_key(gone), "{gone}");
        }
        assert!(!leg.contains_key("max_completion_tokens"));
        assert_eq!(
            leg["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false,
                   "remote_engine_id": null, "remote_block_ids": null,
                   "remote_host": null, "remote_port": null})
        );
        let chat: Map<String, Value> =
            serde_json::from_str(r#"{"model":"m","messages":[],"max_completion_tokens":9}"#)
                .unwrap();
        assert_eq!(prefill_request(&chat)["max_completion_tokens"], 1);
    }
}

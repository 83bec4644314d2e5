//! One request through the gateway, as the endpoint picker sees it: one ext_proc stream.
//! It reads top to bottom like the proxy's spine ([`crate::request`]), whose parts it
//! reuses, but it forwards nothing: the gateway sends the request where the answer says.
//!
//! 1. **read** ([`read_request`]): the request headers (body modes, subset hint), then
//!    the body.
//! 2. **admit** ([`resolve`], [`model_slot`]): the model, the model's concurrency slot.
//! 3. **prepare** ([`prepare`]): the prompt rendered, tokenized and hashed for the model's
//!    policy; the session named. A model with `pools` then chooses its pool as the spine
//!    does ([`crate::request::pool_choice::choose_pool`]); the rest picks among its instances.
//! 4. **queue** ([`queue`]): under `policy: kv`, a bounded wait while every instance is
//!    busy.
//! 5. **pick** ([`pick_with_fallbacks`]): among the instances that take whole requests (not
//!    prefill-only ones, [`not_allowed`]) and the subset hint allows, the
//!    pick (its load booked; with several picker replicas, the one their model's decider
//!    chose, [`steer`]) and the fallbacks after it.
//! 6. **answer**: the endpoints in the destination header and the dynamic metadata (with
//!    full duplex bodies, the request body carried back); a refusal instead becomes an
//!    immediate response (400/404/413, 429 shed, 503 no endpoint).
//! 7. **follow** ([`follow`]): the response's messages; the load moves to the endpoint
//!    that served and is released when the response ends or the stream closes.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::HeaderValueOption;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use kvmesh_wire::ext_proc::messages::{
    BodyMode, Half, body_answer, headers_answer, immediate, pick_metadata, set_header,
    trailers_answer,
};
use kvmesh_wire::ext_proc::request::Seen;

use crate::frontend::epp::decide::{
    Refusal, endpoint_list, model_slot, not_allowed, pick_with_fallbacks, prepare, queue, resolve,
};
use crate::frontend::epp::follow::{Decided, follow};
use crate::frontend::epp::request_read::{Unread, read_request};
use crate::frontend::epp::settings::Settings;
use crate::frontend::epp::wire::Wire;
use crate::openai::api_error::ApiError;
use crate::request::admit::instances_for;
use crate::request::pick::steer;
use crate::request::pool_choice::choose_pool;
use crate::state::shared::State;

/// Serves one ext_proc stream to its end.
pub(crate) async fn exchange(state: Arc<State>, settings: Arc<Settings>, mut wire: Wire) {
    let metrics = &state.metrics.epp;
    let _open = metrics.exchange();
    // 1. read
    let seen = match read_request(&mut wire, &settings, state.limits.max_body_bytes).await {
        Ok(seen) => seen,
        Err(Unread::Gone) => return,
        Err(Unread::TooLarge) => {
            let limit = state.limits.max_body_bytes;
            let refusal = Refusal::new("", ApiError::BodyTooLarge { limit });
            refuse(&wire, &state, &refusal, Instant::now()).await;
            return;
        }
        Err(Unread::Protocol(reason, status)) => {
            metrics.protocol_error(reason);
            wire.fail(status).await;
            return;
        }
    };
    let started = Instant::now();
    // 2. admit
    let resolved = match resolve(&state, &seen) {
        Ok(resolved) => resolved,
        Err(refusal) => return refuse(&wire, &state, &refusal, started).await,
    };
    let pool = Arc::clone(&resolved.pool);
    let instances = match instances_for(&pool, resolved.adapter.as_ref()) {
        Ok(instances) => instances,
        Err(error) => {
            let refusal = Refusal::new(pool.name(), error);
            return refuse(&wire, &state, &refusal, started).await;
        }
    };
    let _slot = match model_slot(&state, &pool).await {
        Ok(slot) => slot,
        Err(refusal) => return refuse(&wire, &state, &refusal, started).await,
    };
    // 3. prepare
    let picker = match prepare(&state, &pool, &resolved, &seen).await {
        Ok(picker) => picker,
        Err(refusal) => return refuse(&wire, &state, &refusal, started).await,
    };
    // 3. the pool (models with pools), as the spine chooses it
    let instances = choose_pool(&pool, &instances, &picker).map_or(instances, |c| c.instances);
    // 4. queue
    if let Err(refusal) = queue(&pool, &instances, &picker).await {
        return refuse(&wire, &state, &refusal, started).await;
    }
    // 5. pick
    let excluded = match not_allowed(&pool, &instances, seen.subset.as_deref()) {
        Ok(excluded) => excluded,
        Err(refusal) => return refuse(&wire, &state, &refusal, started).await,
    };
    let steer = steer(&instances, &picker, &excluded).await;
    let picked = pick_with_fallbacks(
        &state,
        &pool,
        &instances,
        &picker,
        (excluded, steer),
        settings.fallbacks,
    );
    let (pick, order) = match picked {
        Ok(picked) => picked,
        Err(refusal) => return refuse(&wire, &state, &refusal, started).await,
    };
    // 6. answer
    let endpoints = endpoint_list(&instances, &order);
    for answer in pick_answers(&settings, &seen, &endpoints) {
        if !wire.send(answer).await {
            return;
        }
    }
    metrics.decided(pool.name(), 200, started.elapsed().as_secs_f64());
    // 7. follow
    let decided = Decided {
        model: pool.name(),
        instances: &instances,
        picker: &picker,
        order,
    };
    follow(
        &mut wire,
        &settings,
        metrics,
        &decided,
        pick,
        seen.modes.response,
    )
    .await;
}

/// The answers naming `endpoints`, in the order the gateway expects them for `seen`'s body
/// mode: with full duplex, the deferred headers answer (carrying the pick) then the body
/// carried back; with a buffered body, the body answer carrying the pick (its headers were
/// answered before it came); without a body, the headers answer. Trailers that ended the
/// body are answered last.
fn pick_answers(settings: &Settings, seen: &Seen, endpoints: &str) -> Vec<ProcessingResponse> {
    let set = || -> Vec<HeaderValueOption> {
        vec![set_header(
            &settings.destination_header,
            endpoints.as_bytes(),
        )]
    };
    let metadata = || {
        Some(pick_metadata(
            &settings.namespace,
            &settings.destination_header,
            endpoints,
        ))
    };
    let mut answers = Vec::with_capacity(3);
    match &seen.body {
        Some(_) if seen.modes.request == BodyMode::Buffered => {
            answers.push(body_answer(Half::Request, None, set(), metadata()));
        }
        Some(body) => {
            answers.push(headers_answer(Half::Request, set(), metadata()));
            let echo = (body.to_vec(), !seen.trailers);
            answers.push(body_answer(Half::Request, Some(echo), Vec::new(), None));
        }
        None => answers.push(headers_answer(Half::Request, set(), metadata())),
    }
    if seen.trailers {
        answers.push(trailers_answer(Half::Request));
    }
    answers
}

/// Answers with the refusal as an immediate response, and counts it.
async fn refuse(wire: &Wire, state: &State, refusal: &Refusal, started: Instant) {
    let status = refusal.status();
    state
        .metrics
        .epp
        .decided(&refusal.model, status, started.elapsed().as_secs_f64());
    let answer = immediate(status, refusal.error.body(), refusal.retry_after_secs());
    wire.send(answer).await;
}

//! Preparing a request for routing (phase 2 of [`crate::request`]): the model's policy,
//! or under `policy: kv` the prompt rendered, tokenized and hashed into blocks; and the
//! prompt's tokens charged to the API key.

use std::time::Instant;

use bytes::Bytes;

use crate::auth::{KeyPermit, prompt_tokens};
use crate::kv_route::offload;
use crate::kv_route::prepare::{InvalidPrompt, Prepared, RouteInput};
use crate::kv_route::{KvRequest, KvRouter};
use crate::policy::Policy;
use crate::pool::{Balancer, ModelPool};
use crate::request::record::Record;
use crate::route::Route;
use crate::state::State;

/// How one request picks its instances.
pub(crate) enum Picker<'a> {
    /// A policy over the instances.
    Policy(&'a dyn Policy),
    /// `policy: kv` with the request's prompt.
    Kv {
        /// The model's router.
        router: &'a KvRouter,
        /// The request as routing sees it.
        request: KvRequest,
    },
}

/// How a request on `route` to `pool` picks its instances: the pool's policy, or KV
/// routing by the prompt of `body` (prepared here: tokenized and hashed; `body` may be
/// rewritten with the prompt's token ids).
pub(crate) async fn prepare<'a>(
    state: &State,
    pool: &'a ModelPool,
    route: Route,
    body: &mut Bytes,
) -> Result<Picker<'a>, InvalidPrompt> {
    let router = match pool.balancer() {
        Balancer::Policy(policy) => return Ok(Picker::Policy(policy.as_ref())),
        Balancer::Kv(router) => router,
    };
    let prepared = prepare_prompt(state, router, route, body, true).await?;
    let request = router.request(&prepared, Instant::now());
    if let Some(rewritten) = prepared.rewritten {
        *body = rewritten;
    }
    Ok(Picker::Kv {
        router: router.as_ref(),
        request,
    })
}

/// The prompt of `body` on `route` as `router` sees it: rendered, tokenized and hashed
/// (off the reactor when long). `forward`: the body will be sent, so a rewrite with the
/// prompt's token ids is wanted.
pub(crate) async fn prepare_prompt(
    state: &State,
    router: &KvRouter,
    route: Route,
    body: &Bytes,
    forward: bool,
) -> Result<Prepared, InvalidPrompt> {
    offload::prepare(
        state.preprocess.as_deref(),
        router.preparer(),
        route,
        body,
        forward,
    )
    .await
}

/// Charges the prompt's tokens to the key, and meters the completion when the key has a
/// tokens-per-minute limit.
pub(crate) fn charge_prompt(
    permit: &KeyPermit,
    picker: &Picker<'_>,
    body_len: usize,
    record: &mut Record,
) {
    if !permit.key().meters_tokens() {
        return;
    }
    let tokenized = match picker {
        Picker::Kv { request, .. } => match &request.input {
            RouteInput::Tokens(blocks) => Some(blocks.tokens as u64),
            RouteInput::Fallback(_) => None,
        },
        Picker::Policy(_) => None,
    };
    permit.charge_prompt(prompt_tokens(tokenized, body_len));
    record.meter = Some(permit.completion_meter());
}

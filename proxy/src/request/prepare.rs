//! Preparing a request for routing (phase 2 of [`crate::request`]): what the model's policy
//! needs to know about the request (under `policy: kv`, the prompt rendered, tokenized and
//! hashed into blocks), and the prompt's tokens charged to the API key.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvmesh_route::prepare::{InvalidPrompt, Prepared, Preparer, PromptKind, offload};
use kvmesh_route::{Balancer, PolicyInput};

use crate::edge::auth::{KeyPermit, prompt_tokens};
use crate::engines::pool::ModelPool;
use crate::openai::route::Route;
use crate::request::frontend::Frontend;
use crate::request::record::Record;
use crate::state::shared::State;

/// How one request picks its instances: the model's policy and its input for the request.
pub(crate) struct Picker<'a> {
    /// The model's policy.
    pub(crate) balancer: &'a Balancer,
    /// What the policy knows about the request.
    pub(crate) input: PolicyInput,
}

/// How a request from `frontend` on `route` to `pool` (for its LoRA `adapter`, if any) picks
/// its instances: the pool's policy, with the prompt of `body` prepared when the policy wants
/// it (tokenized and hashed; `body` may be rewritten with the prompt's token ids) and the
/// request's session named (`kv.session_header`).
pub(crate) async fn prepare<'a, F: Frontend>(
    state: &State,
    pool: &'a ModelPool,
    adapter: Option<&Arc<str>>,
    route: Route,
    body: &mut Bytes,
    frontend: &F,
) -> Result<Picker<'a>, InvalidPrompt> {
    let session = pool
        .balancer()
        .session_header()
        .and_then(|name| frontend.header(name));
    let (picker, rewritten) = picker_for(
        state,
        pool,
        adapter,
        route.prompt_kind(),
        body,
        session,
        true,
    )
    .await?;
    if let Some(rewritten) = rewritten {
        *body = rewritten;
    }
    Ok(picker)
}

/// The picker of a request to `pool` (for `adapter`) whose `body` carries a `kind` prompt,
/// in `session`; with `forward`, also the body rewritten with the prompt's token ids when
/// the policy tokenized it (the endpoint picker forwards nothing: it passes `false`).
pub(crate) async fn picker_for<'a>(
    state: &State,
    pool: &'a ModelPool,
    adapter: Option<&Arc<str>>,
    kind: PromptKind,
    body: &Bytes,
    session: Option<&str>,
    forward: bool,
) -> Result<(Picker<'a>, Option<Bytes>), InvalidPrompt> {
    let balancer = pool.balancer();
    let Some(preparer) = balancer.preparer() else {
        let input = PolicyInput::None;
        return Ok((Picker { balancer, input }, None));
    };
    let threads = state.preprocess.as_deref();
    let prepared = match adapter {
        Some(adapter) => {
            let preparer = preparer.for_adapter(Arc::clone(adapter));
            offload::prepare(threads, &preparer, kind, body, forward).await?
        }
        None => offload::prepare(threads, preparer, kind, body, forward).await?,
    };
    let input = balancer.input(&prepared, session, Instant::now());
    Ok((Picker { balancer, input }, prepared.rewritten))
}

/// The prompt of `body` on `route` as `preparer` sees it: rendered, tokenized and hashed
/// (off the reactor when long). `forward`: the body will be sent, so a rewrite with the
/// prompt's token ids is wanted.
pub(crate) async fn prepare_prompt(
    state: &State,
    preparer: &Preparer,
    route: Route,
    body: &Bytes,
    forward: bool,
) -> Result<Prepared, InvalidPrompt> {
    offload::prepare(
        state.preprocess.as_deref(),
        preparer,
        route.prompt_kind(),
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
    let tokenized = picker.input.prompt_tokens().map(|tokens| tokens as u64);
    permit.charge_prompt(prompt_tokens(tokenized, body_len));
    record.meter = Some(permit.completion_meter());
}

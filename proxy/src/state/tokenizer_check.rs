//! The tokenizer check of each instance of a `policy: kv` model with a `tokenizer`: once,
//! when the instance registers (static config or discovery), a background task sends the
//! probes of [`kvmesh_route::kv::probes`] to its engine's `POST /tokenize` and compares the
//! token ids with the proxy's own ([`kvmesh_route::kv::compare`]); the router records the
//! outcome ([`kvmesh_route::kv::KvRouter::record_tokenizer_check`]). Nothing of it is on the
//! request path: routing reads the outcome from an `ArcSwap`.
//!
//! The engine may not be ready yet: connect errors, timeouts, 5xx, 408 and 429 are retried
//! (backoff 250 ms doubling to 5 s, each try bounded by `kv.tokenizer_check.timeout`) until
//! it answers or `kv.tokenizer_check.deadline` passes (then *unchecked*). A 404 (no
//! `/tokenize`: not vLLM, or a model it does not serve) or another refusal is *unchecked*,
//! not an error. The task ends early when the instance leaves or its pool is retired.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header;
use kvmesh_route::kv::{Probe, TokenizerOutcome, compare, engine_ids, probes};
use pingora_http::RequestHeader;
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep, timeout};

use crate::engines::instance::{Instance, Membership};
use crate::engines::pool::ModelPool;
use crate::engines::upstream_session::UpstreamSession;
use crate::state::shared::State;

/// The first pause before asking a silent engine again.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
/// The longest pause between two tries.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Most bytes of a refusal's body quoted in the outcome.
const QUOTED_BYTES: usize = 200;
/// Most bytes of an answer read (the probes' ids take a few KiB).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Spawns a check of every instance of every model of `state` not checked yet.
pub(crate) fn spawn_checks(state: &Arc<State>, tasks: &mut JoinSet<()>) {
    for pool in state.registry.pools() {
        for instance in pool.instances().iter() {
            spawn_check(state, &pool, instance, tasks);
        }
    }
}

/// Spawns the check of `instance` of `pool` into `tasks` when its model uses `policy: kv`
/// with a tokenizer and `kv.tokenizer_check.enabled`, and it has no outcome yet.
pub(crate) fn spawn_check(
    state: &Arc<State>,
    pool: &Arc<ModelPool>,
    instance: &Arc<Instance>,
    tasks: &mut JoinSet<()>,
) {
    let Some(router) = pool.balancer().kv_router() else {
        return;
    };
    let checks = router.tokenizer_checks();
    if !checks.settings().enabled
        || router.preparer().tokenizer().is_none()
        || checks.outcome(instance.id()).is_some()
    {
        return;
    }
    tasks.spawn(check(
        Arc::clone(state),
        Arc::clone(pool),
        Arc::clone(instance),
    ));
}

async fn check(state: Arc<State>, pool: Arc<ModelPool>, instance: Arc<Instance>) {
    let Some(router) = pool.balancer().kv_router() else {
        return;
    };
    let Some(tokenizer) = router.preparer().tokenizer() else {
        return;
    };
    let checks = router.tokenizer_checks();
    let Some(_running) = checks.start(instance.id()) else {
        return;
    };
    let outcome = match probes(tokenizer, pool.name()) {
        Ok(probes) => {
            let settings = checks.settings();
            let deadline = Instant::now() + settings.deadline;
            match ask_all(
                &state,
                &pool,
                &instance,
                &probes,
                settings.timeout,
                deadline,
            )
            .await
            {
                Some(outcome) => outcome,
                None => return,
            }
        }
        Err(reason) => TokenizerOutcome::Unchecked(format!("the proxy cannot tokenize {reason}")),
    };
    match &outcome {
        TokenizerOutcome::Agreed => tracing::info!(
            model = %pool.name(),
            instance = %instance.url(),
            "the engine's /tokenize gives the proxy's token ids for every probe"
        ),
        TokenizerOutcome::Mismatched(mismatch) => tracing::warn!(
            model = %pool.name(),
            instance = %instance.url(),
            probe = mismatch.probe,
            position = mismatch.position,
            proxy_token = ?mismatch.proxy_token,
            engine_token = ?mismatch.engine_token,
            proxy_tokens = mismatch.proxy_tokens,
            engine_tokens = mismatch.engine_tokens,
            "the engine tokenizes a probe otherwise than the proxy's tokenizer and chat \
             template: its KV blocks can never match the proxy's hashes, so it is scored by \
             predictions alone (admin /health reports the model degraded); give the model \
             the engine's tokenizer directory"
        ),
        TokenizerOutcome::Unchecked(reason) => tracing::info!(
            model = %pool.name(),
            instance = %instance.url(),
            %reason,
            "the engine's tokenizer is not compared with the proxy's"
        ),
    }
    router.record_tokenizer_check(instance.id(), outcome);
}

/// Asks for every probe in turn; the first mismatch ends it. `None`: the instance left or
/// its pool was retired meanwhile.
async fn ask_all(
    state: &State,
    pool: &ModelPool,
    instance: &Instance,
    probes: &[Probe],
    timeout_each: Duration,
    deadline: Instant,
) -> Option<TokenizerOutcome> {
    for probe in probes {
        let mut backoff = FIRST_BACKOFF;
        let ids = loop {
            if instance.membership() == Membership::Removed || pool.is_retired() {
                return None;
            }
            let error = match timeout(timeout_each, tokenize(state, instance, &probe.body)).await {
                Ok(Ok((200, body))) => match engine_ids(&body) {
                    Ok(ids) => break ids,
                    Err(reason) => return Some(TokenizerOutcome::Unchecked(reason)),
                },
                Ok(Ok((404, _))) => {
                    return Some(TokenizerOutcome::Unchecked(
                        "the engine has no /tokenize (404)".to_string(),
                    ));
                }
                Ok(Ok((status, body))) if !retried(status) => {
                    let quoted =
                        String::from_utf8_lossy(&body[..body.len().min(QUOTED_BYTES)]).into_owned();
                    return Some(TokenizerOutcome::Unchecked(format!(
                        "/tokenize answered {status}: {quoted}"
                    )));
                }
                Ok(Ok((status, _))) => format!("/tokenize answered {status}"),
                Ok(Err(error)) => error,
                Err(_) => format!("no answer within {timeout_each:?}"),
            };
            if Instant::now() + backoff > deadline {
                return Some(TokenizerOutcome::Unchecked(format!(
                    "no usable /tokenize answer before kv.tokenizer_check.deadline: {error}"
                )));
            }
            tracing::debug!(instance = %instance.url(), %error, "tokenizer check: asking again");
            sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        };
        if let Some(mismatch) = compare(probe, &ids) {
            return Some(TokenizerOutcome::Mismatched(mismatch));
        }
    }
    Some(TokenizerOutcome::Agreed)
}

/// Whether an answer of `status` may change on a later try (the engine is starting or busy).
fn retried(status: u16) -> bool {
    status >= 500 || status == 408 || status == 429
}

/// One `POST /tokenize` with `body`: the status and the answer's body.
async fn tokenize(
    state: &State,
    instance: &Instance,
    body: &str,
) -> Result<(u16, Vec<u8>), String> {
    let (mut session, _) = state
        .upstream
        .session(instance.peer())
        .await
        .map_err(|error| error.to_string())?;
    let mut request =
        RequestHeader::build("POST", b"/tokenize", Some(4)).map_err(|e| e.to_string())?;
    request
        .insert_header(header::HOST, instance.host_header().clone())
        .and_then(|()| request.insert_header(header::USER_AGENT, "kvmesh-tokenizer-check"))
        .and_then(|()| request.insert_header(header::CONTENT_TYPE, "application/json"))
        .and_then(|()| request.insert_header(header::CONTENT_LENGTH, body.len().to_string()))
        .map_err(|error| error.to_string())?;
    session
        .write_request_header(Box::new(request))
        .await
        .map_err(|error| error.to_string())?;
    session
        .write_request_body(Bytes::copy_from_slice(body.as_bytes()), true)
        .await
        .map_err(|error| error.to_string())?;
    session
        .finish_request_body()
        .await
        .map_err(|error| error.to_string())?;
    session
        .read_response_header()
        .await
        .map_err(|error| error.to_string())?;
    let status = session
        .response_header()
        .map(|header| header.status.as_u16())
        .ok_or("no response header")?;
    let mut answer = Vec::new();
    while let Some(piece) = session
        .read_response_body()
        .await
        .map_err(|error| error.to_string())?
    {
        if answer.len() + piece.len() > MAX_ANSWER_BYTES {
            return Err(format!("an answer over {MAX_ANSWER_BYTES} bytes"));
        }
        answer.extend_from_slice(&piece);
    }
    state
        .upstream
        .release(UpstreamSession::Pingora(Box::new(session)), instance.peer())
        .await;
    Ok((status, answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_answers_that_may_change_are_retried() {
        for status in [500, 502, 503, 504, 408, 429] {
            assert!(retried(status), "{status}");
        }
        for status in [400, 401, 403, 404, 405, 415, 422] {
            assert!(!retried(status), "{status}");
        }
    }
}

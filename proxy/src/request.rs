//! The spine: one proxied request, from a read body to the end of its answer, for every
//! front end (the HTTP/1.1 fast path, pingora's h2/TLS/fallback path and KServe gRPC).
//! The front end parses the request, authenticates it, reads the body (a multipart upload
//! to an engine route only its start: the rest streams, [`body`]) and calls [`proxy`]; it
//! writes what the spine hands it through its [`Frontend`]. In order:
//!
//! 1. **admit** ([`admit`]): `model` and `stream` from the body (on an engine's own
//!    route also from a form field, the query or a header; its admin routes only for keys
//!    allowed them), the model's pool (an alias rewritten, a LoRA adapter kept), the API
//!    key's own limits, the model's concurrency slot.
//! 2. **prepare** ([`prepare`]): the model's policy, or under `policy: kv` the prompt
//!    rendered, tokenized and hashed into blocks (an adapter's with its seed); the prompt
//!    charged to the key; the instances to pick from (an adapter's: those serving it; a
//!    model with pools: the pool [`pool_choice`] chooses by the prompt's length and TTFT
//!    target).
//! 3. **queue** ([`pick::queue`]): under `policy: kv`, a bounded wait while every instance
//!    is busy.
//!    A disaggregated model's request then runs its **prefill leg** ([`prefill`]) on a
//!    prefill instance, and the rest below is its decode leg, carrying the prefill's
//!    `kv_transfer_params` (vLLM), on a decode instance; SGLang's prefill leg is only sent
//!    here, and its answer read after the decode leg's (8).
//! 4. **pick** ([`pick`]): the next instance not tried yet (`policy: kv` books the load).
//! 5. **attempt** ([`attempt`]): send, read the response head within the first-byte
//!    timeout; a failure before it picks again ([`attempt::Failover`]), unless a streamed
//!    body's later pieces were sent (they cannot be sent again).
//! 6. **respond** ([`respond`]): the engine's status judged (5xx counts towards
//!    ejection); a retryable one (5xx, 429), like a first-byte timeout, is dropped and the
//!    request picks again after a backoff, within `limits.retries` and the model's retry
//!    budget.
//! 7. **relay** ([`relay`]): the response head, then the body piece by piece (SSE timing,
//!    metering, an error event if the engine breaks off). A whole answer's usage goes back
//!    to the booking ([`pick::report_cached`]): its `cached_tokens` checks the KV index.
//!    A stream whose engine breaks off mid-way **migrates** ([`migrate`]): it goes back to
//!    4 with a continuation of what was sent, relayed into the same client answer (a stream
//!    of several choices then goes back to 4 for each choice left, in turn).
//! 8. **release** ([`release`]): the engine connection back to its pool, or its failure
//!    counted; the booking, in-flight count and slot guards dropped; a prefill leg sent
//!    beside the decode leg read and judged.
//! 9. **record** ([`record`]): metrics and the log line, written by the front end that
//!    owns the [`Record`] once the spine returns (it also records what it refused before
//!    admission).
//!
//! While tracing is on ([`trace`]), the request's span and a child per phase start and end
//! at these boundaries; off, those calls do nothing.

pub(crate) mod admit;
pub(crate) mod attempt;
pub(crate) mod body;
pub(crate) mod frontend;
pub(crate) mod migrate;
pub(crate) mod pick;
pub(crate) mod pool_choice;
pub(crate) mod prefill;
pub(crate) mod prepare;
pub(crate) mod record;
pub(crate) mod relay;
pub(crate) mod release;
pub(crate) mod respond;
pub(crate) mod stop;
pub(crate) mod trace;

use std::sync::Arc;

use http::HeaderValue;

use crate::edge::auth::ApiKey;
use crate::metrics::failure::FailureKind;
use crate::metrics::families::GaugeGuard;
use crate::openai::api_error::ApiError;
use crate::openai::route::Route;
use crate::state::shared::State;
use admit::{
    admit_key, check_route_access, instances_for, model_slot, resolve_engine_model, resolve_model,
};
use attempt::{Failover, attempt};
use body::RequestBody;
use frontend::Frontend;
use kvmesh_route::prepare::{InvalidPrompt, Preparer};
use migrate::{Migration, migrated};
use pick::{pick, queue, report_cached, steer, whole_request_exclusions};
use pool_choice::choose_pool;
use prefill::{Prefilled, prefill};
use prepare::{charge_prompt, prepare};
use record::Record;
use relay::{RelayEnd, end_broken, relay};
use release::release;
use respond::judge;
use stop::Stop;
use trace::{Phase, RequestTrace};

/// Proxies one request whose `body` its front end has read (`key`: the API key it
/// authenticated); returns whether the client connection can serve another request.
pub(crate) async fn proxy<F: Frontend>(
    state: &State,
    frontend: &mut F,
    record: &mut Record,
    key: Option<Arc<ApiKey>>,
    body: RequestBody,
) -> bool {
    let mut trace = RequestTrace::start(state, &*frontend, record);
    let reusable = match run(state, frontend, record, &mut trace, key, body).await {
        Ok(reusable) => reusable,
        Err(Stop::Answer(error)) if record.migrations > 0 => {
            tracing::debug!(
                code = error.code(),
                "a migrated stream found no instance to continue on"
            );
            if let Some(pool) = record.pool.as_deref() {
                pool.metrics().migration_failures.inc();
            }
            end_broken(
                frontend,
                FailureKind::Reset,
                record,
                state.limits.write_timeout,
            )
            .await
        }
        Err(Stop::Answer(error)) => frontend.reject(record, &state.metrics, &error).await,
        Err(Stop::ClientGone) => {
            record.client_gone = true;
            false
        }
    };
    trace.finish(record);
    reusable
}

/// The phases, in order; `Err` when the request stops before the engine's answer.
async fn run<F: Frontend>(
    state: &State,
    frontend: &mut F,
    record: &mut Record,
    trace: &mut RequestTrace,
    key: Option<Arc<ApiKey>>,
    RequestBody {
        read: body,
        mut rest,
    }: RequestBody,
) -> Result<bool, Stop> {
    // 1. admit
    trace.phase(Phase::Admit);
    let route = record.route.unwrap_or(Route::ChatCompletions);
    let resolved = match route {
        Route::Engine(engine) => {
            check_route_access(engine, route.label(), key.as_deref())?;
            resolve_engine_model(state, &*frontend, body)?
        }
        _ => resolve_model(state, body)?,
    };
    record.stream = resolved.stream;
    let pool = resolved.pool;
    trace.model(&pool, resolved.adapter.as_deref());
    record.pool = Some(Arc::clone(&pool));
    let permit = admit_key(state, key, pool.name())?;
    let _slot = model_slot(state, &pool, frontend.gone()).await?;
    // 2. prepare
    trace.phase(Phase::Prepare);
    let mut body = resolved.body;
    let adapter = resolved.adapter.as_ref();
    let mut picker = prepare(state, &pool, adapter, route, &mut body, &*frontend)
        .await
        .map_err(|InvalidPrompt(message)| ApiError::InvalidPrompt(message))?;
    record.prompt_tokens = picker.input.prompt_tokens().map(|tokens| tokens as u64);
    if let Some(permit) = permit.as_ref() {
        charge_prompt(permit, &picker, body.len(), record);
    }
    let _in_flight = GaugeGuard::new(&pool.metrics().in_flight);
    let mut instances = instances_for(&pool, adapter)?;
    // 2a. the pool (models with pools)
    let pooled = choose_pool(&pool, &instances, &picker);
    if let Some(choice) = &pooled {
        instances = Arc::clone(&choice.instances);
    }
    // 3. queue
    trace.phase(Phase::Queue);
    queue(&pool, &instances, &picker, frontend.gone()).await?;
    let mut failover = Failover::new(state, &pool);
    // Prefill-only instances take no whole request and no decode leg.
    failover.excluded = whole_request_exclusions(&pool, &instances)?;
    let tokenizer = pool.balancer().preparer().and_then(Preparer::tokenizer);
    let mut migration = Migration::new(
        route,
        &body,
        record.stream,
        pool.migration_limit(),
        tokenizer,
    );
    // 3a. the prefill leg (disaggregated models)
    let mut prefilled = match pool.disaggregation() {
        // A streamed body is sent once, whole, to one instance.
        Some(_) if rest.is_some() => None,
        None => None,
        Some(config) => {
            trace.phase(Phase::Prefill);
            let model = (&*pool, config);
            let leg = (&*record, &mut *trace);
            let prefilled =
                prefill(state, frontend, model, &instances, &picker, &body, leg).await?;
            if let Prefilled::Remote {
                instance,
                body: decode_leg,
                ..
            } = &prefilled
            {
                body = decode_leg.clone();
                // The decode instance pulls the prompt's KV: it prefills only the tail.
                picker.input = picker.input.pulled(config.transfer_ns_per_token());
                // The decode leg goes elsewhere (a `both` instance could take both).
                if let Some(at) = instances.iter().position(|i| Arc::ptr_eq(i, instance)) {
                    failover.excluded.insert(at);
                }
            }
            Some(prefilled)
        }
    };
    loop {
        // 4. pick (a replica asks its model's decider first, when another replica is it; not
        // for a decode leg that pulls its KV: the decider would cost its prefill whole)
        let steer = match prefilled {
            Some(Prefilled::Remote { .. }) => None,
            _ => steer(&instances, &picker, &failover.excluded).await,
        };
        let mut pick = match pick(&instances, &picker, &failover.excluded, steer) {
            Ok(pick) => pick,
            Err(why) => return Err(failover.exhausted(state, &pool, why).into()),
        };
        if pooled.is_some() || prefilled.is_some() {
            pick.route = Some(explained(
                pooled.as_ref().map(|p| p.explanation.as_str()),
                prefilled.as_ref(),
                pick.route.as_ref(),
            ));
        }
        record.instance = Some(pick.instance.instance_header().clone());
        record.kv_route.clone_from(&pick.route);
        let in_flight = pick.instance.start_request();
        // 5. attempt
        let engine_trace = trace.attempt(&pick.instance);
        let request_id = &record.request_id;
        let sent = (&body, rest.as_mut());
        let attempted = attempt(state, frontend, &pick, sent, request_id, engine_trace).await;
        if rest.is_some_and(|rest| rest.consumed) {
            failover.last_attempt();
        }
        let mut engine = match attempted {
            Ok(engine) => engine,
            Err(error) => {
                drop(in_flight);
                trace.attempt_failed(&error);
                failover.failed(state, &pool, &instances, &pick, error)?;
                failover.backoff(frontend).await?;
                continue;
            }
        };
        // 6. respond
        let Some(status) = judge(state, &pick.instance, &engine) else {
            return Ok(false);
        };
        trace.answered(status);
        if failover.retries_status(state, &pool, &instances, &pick, status) {
            drop((engine, in_flight));
            trace.retried();
            failover.backoff(frontend).await?;
            continue;
        }
        if record.migrations == 0 {
            record.status = status;
        }
        // 7. relay
        let metrics = pool.metrics();
        trace.relay();
        let mut end = relay(
            frontend,
            &mut engine,
            &pick,
            record,
            metrics,
            &state.limits,
            migration.as_mut(),
        )
        .await;
        trace.relayed(&end);
        // The engine's cached_tokens checks the KV index: a whole answer to the prompt the
        // pick was made for (not a continuation, not a decode leg that pulled its KV).
        let remote_prefill = matches!(prefilled, Some(Prefilled::Remote { .. }));
        if matches!(end, RelayEnd::Complete) && record.migrations == 0 && !remote_prefill {
            report_cached(&pick, &record.tokens);
        }
        // A stream that broke off migrates; a continuation that finished one of several
        // choices hands over to the next unfinished one.
        let next = match end {
            RelayEnd::Broken(kind) => migration
                .as_mut()
                .and_then(Migration::next_body)
                .map(|body| (body, Some(kind))),
            RelayEnd::ChoiceDone => migration
                .as_mut()
                .and_then(Migration::next_choice_body)
                .map(|body| (body, None)),
            _ => None,
        };
        if let Some((continuation, broke)) = next {
            match broke {
                Some(kind) => {
                    migrated(state, &pool, &pick, kind, record);
                    trace.migrating(kind);
                    failover.excluded.insert(pick.index);
                }
                // The engine's answer is whole: its connection goes back to the pool.
                None => {
                    release(state, &pick.instance, engine, end, record).await;
                }
            }
            body = continuation;
            continue;
        }
        let unfinished = match end {
            RelayEnd::Broken(kind) => Some(kind),
            RelayEnd::ChoiceDone => Some(FailureKind::Reset),
            _ => None,
        };
        if let Some(kind) = unfinished {
            // Nowhere to go on: the client's stream ends with an error event.
            end = RelayEnd::UpstreamFailed {
                kind,
                clean: end_broken(frontend, kind, record, state.limits.write_timeout).await,
            };
        }
        if matches!(end, RelayEnd::UpstreamFailed { .. })
            && (unfinished.is_some() || record.migrations > 0)
        {
            // A stream that migrated, or was to, ends broken after all.
            metrics.migration_failures.inc();
        }
        // 8. release (a prefill leg sent beside the decode leg answers by now)
        let reusable = release(state, &pick.instance, engine, end, record).await;
        drop(in_flight);
        if let Some(pending) = prefilled.as_mut().and_then(Prefilled::take_pending) {
            pending.finish(state, &pool).await;
        }
        return Ok(reusable);
    }
}

/// `x-kvmesh-route` of a request whose model has pools or is disaggregated: the pool, the
/// prefill leg, then the (decode leg's) choice.
fn explained(
    pool: Option<&str>,
    prefilled: Option<&Prefilled>,
    decode: Option<&HeaderValue>,
) -> HeaderValue {
    let mut text = pool.unwrap_or("").to_string();
    if let Some(prefilled) = prefilled {
        text.push_str(&prefilled.explain());
    }
    text.push_str(decode.and_then(|value| value.to_str().ok()).unwrap_or(""));
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

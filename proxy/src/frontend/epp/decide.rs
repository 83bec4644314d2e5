//! The endpoint picker's decision (phases 2 to 5 of [`crate::frontend::epp::exchange`]), made of the
//! spine's own parts: the model from the body (or, for a request without one, from the
//! `x-gateway-model-name` header or the only model), the model's concurrency slot, the
//! prompt prepared for its policy, the KV policy's admission queue, then the pick among
//! the instances the gateway allows (the subset hint) and the fallbacks after it.

use std::sync::Arc;

use bytes::Bytes;
use http::Method;
use kvmesh_route::kv::Steer;
use kvmesh_route::prepare::{InvalidPrompt, PromptKind};
use kvmesh_route::{Candidates, Excluded, NoPick};
use kvmesh_wire::ext_proc::request::Seen;
use tokio::sync::OwnedSemaphorePermit;

use crate::engines::clock::now_millis;
use crate::engines::instance::Instance;
use crate::engines::pool::ModelPool;
use crate::openai::api_error::ApiError;
use crate::openai::route::{RouteMatch, match_route};
use crate::request::admit::{Resolved, model_slot as spine_slot, resolve_model};
use crate::request::pick::{
    Pick, overloaded, pick, queue as spine_queue, whole_request_exclusions,
};
use crate::request::prepare::{Picker, picker_for};
use crate::request::stop::Stop;
use crate::state::shared::State;

/// Header naming the model of a request without a body (set by the Inference Extension's
/// body-based router).
pub(crate) const MODEL_HEADER: &str = "x-gateway-model-name";

/// A request the picker does not route: the gateway answers the client itself.
#[derive(Debug)]
pub(crate) struct Refusal {
    /// The model it named (`""`: none resolved).
    pub(crate) model: String,
    /// What went wrong.
    pub(crate) error: ApiError,
}

impl Refusal {
    /// `error` for a request to `model` (`""`: none resolved).
    pub(crate) fn new(model: &str, error: ApiError) -> Self {
        Self {
            model: model.to_string(),
            error,
        }
    }

    /// The status the client gets: the proxy's, except that a request shed because every
    /// instance or the model's slots are taken is 429, as the protocol asks.
    pub(crate) fn status(&self) -> u16 {
        match self.error {
            ApiError::Overloaded { .. } | ApiError::ConcurrencyLimited { .. } => 429,
            _ => self.error.status(),
        }
    }

    /// Seconds the client should wait before retrying, when the error says.
    pub(crate) fn retry_after_secs(&self) -> Option<u64> {
        match self.error {
            ApiError::Overloaded {
                retry_after_secs, ..
            }
            | ApiError::NoHealthyInstance {
                retry_after_secs, ..
            }
            | ApiError::ConcurrencyLimited {
                retry_after_secs, ..
            }
            | ApiError::RateLimited {
                retry_after_secs, ..
            } => Some(retry_after_secs),
            _ => None,
        }
    }
}

/// The model of the request `seen`.
pub(crate) fn resolve(state: &State, seen: &Seen) -> Result<Resolved, Refusal> {
    if let Some(body) = seen.body.as_ref().filter(|body| !body.is_empty()) {
        return resolve_model(state, body.clone()).map_err(|error| Refusal::new("", error));
    }
    let named = seen.header(MODEL_HEADER).map(str::to_string);
    let only = || {
        let pools = state.registry.pools();
        (pools.len() == 1).then(|| pools[0].name().to_string())
    };
    let Some(model) = named.or_else(only) else {
        return Err(Refusal::new("", ApiError::MissingModel));
    };
    let served = state.registry.resolve(&model).ok_or_else(|| {
        let error = ApiError::ModelNotFound {
            model: model.clone(),
            known: state.registry.known(),
        };
        Refusal::new("", error)
    })?;
    Ok(Resolved {
        pool: served.pool,
        adapter: served.adapter,
        body: Bytes::new(),
        stream: false,
    })
}

/// A slot of the model's concurrency limit, when it has one: the spine's step (the gateway
/// has no client to watch leave; its stream ends the exchange instead).
pub(crate) async fn model_slot(
    state: &State,
    pool: &ModelPool,
) -> Result<Option<OwnedSemaphorePermit>, Refusal> {
    spine_slot(state, pool, std::future::pending())
        .await
        .map_err(|stop| refusal(pool, stop))
}

/// How the request `seen` to `resolved`'s pool picks: its prompt prepared for the pool's
/// policy (nothing rewritten: the gateway forwards the body as the client sent it), its
/// session named by the gateway's copy of the session header.
pub(crate) async fn prepare<'a>(
    state: &State,
    pool: &'a ModelPool,
    resolved: &Resolved,
    seen: &Seen,
) -> Result<Picker<'a>, Refusal> {
    let session = pool
        .balancer()
        .session_header()
        .and_then(|name| seen.header(name));
    // The prompt the route carries, as the data listener reads it.
    let method = seen
        .header(":method")
        .and_then(|method| Method::from_bytes(method.as_bytes()).ok())
        .unwrap_or(Method::POST);
    let path = seen.header(":path").and_then(|path| path.split('?').next());
    let kind = match path.map(|path| match_route(&state.engine_routes, &method, path)) {
        Some(RouteMatch::Found(route)) => route.prompt_kind(),
        _ => PromptKind::Other,
    };
    let adapter = resolved.adapter.as_ref();
    picker_for(state, pool, adapter, kind, &resolved.body, session, false)
        .await
        .map(|(picker, _)| picker)
        .map_err(|InvalidPrompt(message)| {
            Refusal::new(pool.name(), ApiError::InvalidPrompt(message))
        })
}

/// Under `policy: kv`, waits (bounded) while every instance is busy (the spine's step);
/// else 429.
pub(crate) async fn queue(
    pool: &ModelPool,
    instances: &[Arc<Instance>],
    picker: &Picker<'_>,
) -> Result<(), Refusal> {
    spine_queue(pool, instances, picker, std::future::pending())
        .await
        .map_err(|stop| refusal(pool, stop))
}

/// The refusal of a spine step that stopped a request to `pool`.
fn refusal(pool: &ModelPool, stop: Stop) -> Refusal {
    match stop {
        Stop::Answer(error) => Refusal::new(pool.name(), error),
        // No client is watched: nothing leaves before the step ends.
        Stop::ClientGone => Refusal::new(
            pool.name(),
            ApiError::UpstreamUnavailable {
                detail: "the exchange ended".to_string(),
            },
        ),
    }
}

/// The instances the picker may not name for a request of `pool`: those that take no
/// whole request (prefill only, as the spine leaves them out) and those whose `ip:port` is
/// not in the gateway's subset hint. `Err`: nothing of a model that is not disaggregated
/// takes whole requests.
pub(crate) fn not_allowed(
    pool: &ModelPool,
    instances: &[Arc<Instance>],
    subset: Option<&[String]>,
) -> Result<Excluded, Refusal> {
    let mut excluded = whole_request_exclusions(pool, instances)
        .map_err(|error| Refusal::new(pool.name(), error))?;
    if let Some(subset) = subset {
        for (index, instance) in instances.iter().enumerate() {
            if !subset.iter().any(|allowed| allowed == endpoint(instance)) {
                excluded.insert(index);
            }
        }
    }
    Ok(excluded)
}

/// Picks among the instances not `excluded` (booking the request's load; the one `steer`
/// names when it may: the model's decider chose it), then names up to `fallbacks` more in the
/// order the policy would choose them; returns the pick and the endpoints, pick first.
pub(crate) fn pick_with_fallbacks<'a>(
    state: &State,
    pool: &ModelPool,
    instances: &[Arc<Instance>],
    picker: &'a Picker<'a>,
    (mut excluded, steer): (Excluded, Option<Steer>),
    fallbacks: usize,
) -> Result<(Pick<'a>, Vec<usize>), Refusal> {
    let picked = pick(instances, picker, &excluded, steer).map_err(|no_pick| {
        let error = match no_pick {
            NoPick::Busy => overloaded(pool, "every allowed instance is busy"),
            NoPick::Nothing => ApiError::NoHealthyInstance {
                model: pool.name().to_string(),
                retry_after_secs: pool.retry_after_secs(state.health_interval_ms),
            },
        };
        Refusal::new(pool.name(), error)
    })?;
    let mut order = vec![picked.index];
    while order.len() <= fallbacks {
        excluded.insert(order[order.len() - 1]);
        let candidates = Candidates::new(instances, &excluded, now_millis());
        match picker.balancer.peek(&candidates, &picker.input) {
            Some(next) => order.push(next),
            None => break,
        }
    }
    Ok((picked, order))
}

/// Where the gateway reaches `instance`: the `host:port` of its URL (an `ip:port` when the
/// instance is registered by address, as the agents do).
pub(crate) fn endpoint(instance: &Instance) -> &str {
    instance.url().authority()
}

/// `host:port,host:port,...` of `order`'s instances.
pub(crate) fn endpoint_list(instances: &[Arc<Instance>], order: &[usize]) -> String {
    let mut list = String::new();
    for &index in order {
        if !list.is_empty() {
            list.push(',');
        }
        list.push_str(endpoint(&instances[index]));
    }
    list
}

/// Books the request on the instance at `index` instead, the one the gateway says served
/// it (nothing when that instance is no longer available).
pub(crate) fn rebook<'a>(
    instances: &[Arc<Instance>],
    picker: &'a Picker<'a>,
    index: usize,
) -> Option<Pick<'a>> {
    let served = &instances[index];
    let others = Excluded::matching(instances, |instance| !Arc::ptr_eq(instance, served));
    pick(instances, picker, &others, None).ok()
}

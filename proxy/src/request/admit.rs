//! Admission (phase 1 of [`crate::request`]): the body's `model` and `stream`, the model's
//! pool (an alias rewritten to the canonical name; a LoRA adapter resolved to its base
//! model's pool and kept as named), the API key's own limits and the
//! model's concurrency slot. The admin port's `POST /debug/route` resolves the model the
//! same way ([`resolve_model`]).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvmesh_wire::request_fields::{FieldsError, ModelName, extract, with_model_name};
use tokio::sync::OwnedSemaphorePermit;

use crate::edge::auth::{ApiKey, KeyPermit, KeyRejection};
use crate::engines::pool::{Instances, ModelPool};
use crate::engines::registry::Served;
use crate::openai::api_error::ApiError;
use crate::openai::engine_model::{MODEL_HEADER, Named, named_model};
use crate::openai::route::EngineRoute;
use crate::request::frontend::{Frontend, unless};
use crate::request::stop::Stop;
use crate::state::shared::State;

/// A request's model, resolved from its body.
pub(crate) struct Resolved {
    /// The model's pool.
    pub(crate) pool: Arc<ModelPool>,
    /// The LoRA adapter the request names (`None`: the base model).
    pub(crate) adapter: Option<Arc<str>>,
    /// The body to forward (rewritten when it named the model by an alias).
    pub(crate) body: Bytes,
    /// The client asked for a stream (`"stream": true`).
    pub(crate) stream: bool,
}

/// Reads `model` and `stream` from `body` and finds the model's pool. An alias is a
/// gateway name: engines know the model by its canonical name, so only then is the body
/// rewritten. An adapter is known to the engines by its own name: the body stays.
pub(crate) fn resolve_model(state: &State, body: Bytes) -> Result<Resolved, ApiError> {
    let fields = extract(&body).map_err(fields_error)?;
    let stream = fields.stream.unwrap_or(false);
    let model = fields.model.ok_or(ApiError::MissingModel)?;
    resolved_from_body(state, &body, &model, stream)
}

/// [`resolve_model`] for a request on an engine route (`engine_routes`), whose model may
/// be named outside its body ([`named_model`]): the only model served when none is named.
pub(crate) fn resolve_engine_model<F: Frontend>(
    state: &State,
    frontend: &F,
    body: Bytes,
) -> Result<Resolved, ApiError> {
    let named = named_model(
        &body,
        frontend.header("content-type"),
        frontend.query(),
        frontend.header(MODEL_HEADER),
    )
    .map_err(fields_error)?;
    let (name, stream) = match named {
        Named::Body(model, stream) => return resolved_from_body(state, &body, &model, stream),
        Named::Outside(name, stream) => (name.into_owned(), stream),
        Named::Nowhere => match state.registry.pools().as_slice() {
            [only] => (only.name().to_string(), false),
            _ => return Err(ApiError::MissingModel),
        },
    };
    let served = served(state, &name)?;
    Ok(Resolved {
        pool: served.pool,
        adapter: served.adapter,
        body,
        stream,
    })
}

/// The 403 for an engine admin `route` (at `path`) unless `key` may use it.
pub(crate) fn check_route_access(
    route: EngineRoute,
    path: &str,
    key: Option<&ApiKey>,
) -> Result<(), ApiError> {
    if route.is_admin() && !key.is_some_and(|key| key.settings().engine_admin) {
        return Err(ApiError::RouteNotAllowed {
            path: path.to_string(),
        });
    }
    Ok(())
}

fn fields_error(error: FieldsError) -> ApiError {
    match error {
        FieldsError::InvalidJson(detail) => ApiError::InvalidJson(detail),
        FieldsError::InvalidShape(detail) => ApiError::InvalidBody(detail),
    }
}

/// The served model or adapter `name`, or the 404 naming what is served.
fn served(state: &State, name: &str) -> Result<Served, ApiError> {
    state
        .registry
        .resolve(name)
        .ok_or_else(|| ApiError::ModelNotFound {
            model: name.to_string(),
            known: state.registry.known(),
        })
}

/// The request for `model`, named in `body`'s JSON (rewritten when it is an alias).
fn resolved_from_body(
    state: &State,
    body: &Bytes,
    model: &ModelName<'_>,
    stream: bool,
) -> Result<Resolved, ApiError> {
    let served = served(state, model.as_str())?;
    let pool = served.pool;
    let body = if pool.name() == model.as_str() || served.adapter.is_some() {
        body.clone()
    } else {
        with_model_name(body, model, pool.name())
    };
    Ok(Resolved {
        pool,
        adapter: served.adapter,
        body,
        stream,
    })
}

/// The instances a request for `adapter` of `pool` picks from; the adapter's instances may
/// have left since it was resolved (404 then, as from an engine that unloaded it).
pub(crate) fn instances_for(
    pool: &ModelPool,
    adapter: Option<&Arc<str>>,
) -> Result<Instances, ApiError> {
    pool.instances_for(adapter.map(|a| &**a))
        .ok_or_else(|| ApiError::ModelNotFound {
            model: adapter.map_or_else(|| pool.name().to_string(), |a| a.to_string()),
            known: pool.name().to_string(),
        })
}

/// Admits a request for `model` under `key`'s own limits (`None`: authentication is off).
pub(crate) fn admit_key(
    state: &State,
    key: Option<Arc<ApiKey>>,
    model: &str,
) -> Result<Option<KeyPermit>, ApiError> {
    let Some(key) = key else {
        return Ok(None);
    };
    key.admit(model, Instant::now())
        .map(Some)
        .map_err(|rejection| key_rejection(state, rejection, model.to_string()))
}

/// The error for a key refused by its own settings (403 or 429); `model` is the requested
/// name.
fn key_rejection(state: &State, rejection: KeyRejection, model: String) -> ApiError {
    match rejection {
        KeyRejection::ModelNotAllowed => {
            state.auth.count_model_not_allowed();
            ApiError::ModelNotAllowed { model }
        }
        KeyRejection::Limited(limit, wait) => ApiError::RateLimited {
            limit: limit.label(),
            retry_after_secs: wait.as_secs_f64().ceil().max(1.0) as u64,
        },
    }
}

/// A slot of the model's concurrency limit, when it has one (waiting for it, bounded,
/// unless the client leaves first: `gone` completes). A model without a limit costs no
/// wait. The spine and the endpoint picker both take their slot here.
pub(crate) async fn model_slot(
    state: &State,
    pool: &ModelPool,
    gone: impl Future<Output = ()>,
) -> Result<Option<OwnedSemaphorePermit>, Stop> {
    let Some(slots) = state.concurrency.get(pool.name()) else {
        return Ok(None);
    };
    match unless(gone, slots.acquire()).await {
        None => Err(Stop::ClientGone),
        Some(Ok(slot)) => Ok(Some(slot)),
        Some(Err(rejection)) => Err(Stop::Answer(ApiError::ConcurrencyLimited {
            model: pool.name().to_string(),
            reason: rejection.describe(),
            retry_after_secs: slots.retry_after_secs(),
        })),
    }
}

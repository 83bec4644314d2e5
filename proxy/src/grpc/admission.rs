//! The edge checks of the HTTP listeners, applied to gRPC requests: the API key (from
//! the `authorization: Bearer <key>` metadata of the call), the key's own limits, and
//! the model's concurrency limit.

use std::sync::Arc;
use std::time::Instant;

use http::header::AUTHORIZATION;
use pingora_http::RequestHeader;
use tokio::sync::OwnedSemaphorePermit;

use crate::api_error::ApiError;
use crate::auth::{ApiKey, AuthFailure, KeyPermit};
use crate::data_app::key_rejection;
use crate::grpc::downstream::Sink;
use crate::grpc::failure::Failure;
use crate::state::State;

/// The call's `authorization` metadata value, if any.
pub(crate) type Credentials = Option<Arc<[u8]>>;

/// The key `credentials` present; `None` when authentication is off.
pub(crate) fn authenticate(
    state: &State,
    credentials: &Credentials,
) -> Result<Option<Arc<ApiKey>>, Failure> {
    if !state.auth.enabled() {
        return Ok(None);
    }
    let unauthorized = |missing| Failure::Api(ApiError::Unauthorized { missing });
    let mut head = RequestHeader::build("POST", b"/", Some(1)).map_err(|_| unauthorized(false))?;
    if let Some(value) = credentials {
        head.insert_header(AUTHORIZATION, &value[..])
            .map_err(|_| unauthorized(false))?;
    }
    state
        .auth
        .authenticate(&head)
        .map_err(|failure| unauthorized(failure == AuthFailure::Missing))
}

/// Admits a request for `model` under `key`'s limits.
pub(crate) fn admit_key(
    state: &State,
    key: Option<Arc<ApiKey>>,
    model: &str,
) -> Result<Option<KeyPermit>, Failure> {
    let Some(key) = key else {
        return Ok(None);
    };
    key.admit(model, Instant::now())
        .map(Some)
        .map_err(|rejection| Failure::Api(key_rejection(state, rejection, model.to_string())))
}

/// A slot of `model`'s concurrency limit (waiting for one, unless the client leaves).
pub(crate) async fn model_slot(
    state: &State,
    model: &str,
    sink: &Sink,
) -> Result<Option<OwnedSemaphorePermit>, Failure> {
    let Some(slots) = state.concurrency.get(model) else {
        return Ok(None);
    };
    let acquired = tokio::select! {
        biased;
        acquired = slots.acquire() => acquired,
        () = sink.closed() => return Err(Failure::Cancelled),
    };
    acquired.map(Some).map_err(|rejection| {
        Failure::Api(ApiError::ConcurrencyLimited {
            model: model.to_string(),
            reason: rejection.describe(),
            retry_after_secs: slots.retry_after_secs(),
        })
    })
}

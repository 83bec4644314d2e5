//! Test-only `POST /sim/kv_events/faults`: fault injection into the ZMQ KV event stream.
//!
//! Body (every field optional): `{"drop_batches": N, "duplicate_stores": N, "restart": true}`.
//! - `drop_batches`: the next N batches are not sent on the PUB socket, but their sequence
//!   numbers are used (a gap) and the replay socket still has them.
//! - `duplicate_stores`: for each of the next N batches holding a `BlockStored`, its first one
//!   is sent again in a batch of its own right after.
//! - `restart`: simulates an engine restart: the prefix cache is emptied and the next batch,
//!   `[AllBlocksCleared]`, is numbered 0 again; the replay buffer starts over.
//!
//! Faults apply to one data-parallel rank's publisher: the one `X-data-parallel-rank` names,
//! else rank 0. Answers `{"pending_drop_batches": N, "pending_duplicate_stores": N}` (that
//! rank's); 400 when the engine does not publish KV events.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use serde::Deserialize;
use serde_json::json;

use super::body::{ResponseBody, json_response};
use super::dp_rank::RequestedRank;
use super::error::ApiError;
use super::state::EngineState;

/// The fault request body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultRequest {
    drop_batches: Option<u64>,
    duplicate_stores: Option<u64>,
    restart: Option<bool>,
}

/// Handles `POST /sim/kv_events/faults` for the data-parallel rank `dp_rank` names (its
/// `X-data-parallel-rank` header; rank 0 without one).
pub(crate) async fn handle(
    state: Arc<EngineState>,
    body: Bytes,
    dp_rank: Option<RequestedRank>,
) -> Response<ResponseBody> {
    match apply(&state, &body, dp_rank).await {
        Ok(res) => res,
        Err(e) => e.into_response(),
    }
}

async fn apply(
    state: &EngineState,
    body: &[u8],
    dp_rank: Option<RequestedRank>,
) -> Result<Response<ResponseBody>, ApiError> {
    let rank = match dp_rank {
        Some(requested) => state.rank(requested.check(state.ranks.len())?),
        None => state.rank(0),
    };
    let Some(faults) = &rank.kv_faults else {
        return Err(ApiError::bad_request(
            "this engine does not publish KV events (start it with --kv-events-endpoint)",
        ));
    };
    let req: FaultRequest = if body.iter().all(u8::is_ascii_whitespace) {
        FaultRequest::default()
    } else {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid fault request: {e}")))?
    };
    if req.restart == Some(true) {
        rank.scheduler
            .reset_prefix_cache(true)
            .await
            .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    }
    if let Some(n) = req.drop_batches {
        faults.drop_batches(n);
    }
    if let Some(n) = req.duplicate_stores {
        faults.duplicate_stores(n);
    }
    let (drops, duplicates) = faults.pending();
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "pending_drop_batches": drops,
            "pending_duplicate_stores": duplicates,
        }),
    ))
}

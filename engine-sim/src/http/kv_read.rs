//! `POST /sim/kv_transfer/read`: a decode engine reads the blocks a prefill leg holds here
//! (the simulated NIXL read), on whichever data-parallel rank holds them; they are freed.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};

use super::body::{ResponseBody, json_response};
use super::error::ApiError;
use super::generation::parse_json;
use super::state::EngineState;
use crate::kv_transfer::pull::{ReadAnswer, ReadRequest};

/// Frees the named hold and answers how many blocks it had; 404 when nothing is held under
/// that request (read already, or its hold expired).
pub(crate) async fn handle(state: Arc<EngineState>, body: Bytes) -> Response<ResponseBody> {
    let request: ReadRequest = match parse_json(&body) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    // The prefill leg ran on one of the data-parallel ranks: the one holding it answers.
    for rank in &state.ranks {
        match rank
            .scheduler
            .read_held(request.request_id.clone(), request.block_ids.clone())
            .await
        {
            Ok(Some(blocks)) => return json_response(StatusCode::OK, &ReadAnswer { blocks }),
            Ok(None) => {}
            Err(gone) => {
                return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, gone.to_string())
                    .into_response();
            }
        }
    }
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no KV is held for that request here: read already, or its hold expired",
    )
    .into_response()
}

//! A prefill engine's bootstrap server (`--disaggregation-mode prefill`, on
//! `--disaggregation-bootstrap-port`): SGLang's `GET /route` and `GET /health`
//! (sgl-project/sglang `python/sglang/srt/disaggregation/common/conn.py` at 0094505d,
//! `CommonKVBootstrapServer`) and the simulator's handshake of a room
//! ([`crate::kv_transfer::bootstrap`]). `PUT /route` (a prefill rank registering) is not
//! served: the simulator's ranks are its own.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::json;

use super::body::{ResponseBody, bytes_response, json_response};
use super::error::ApiError;
use super::generation::parse_json;
use super::state::EngineState;
use crate::kv_transfer::bootstrap::{
    DONE_PATH, DoneRequest, JOIN_PATH, JoinRequest, PrefillRankInfo, PrefillServerInfo, hold_id,
};
use crate::kv_transfer::rooms::JoinError;

/// Largest body a bootstrap request may have.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// Answers one request to the bootstrap server.
pub(crate) async fn handle(
    state: Arc<EngineState>,
    req: Request<Incoming>,
) -> Response<ResponseBody> {
    let path = req.uri().path().to_owned();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => text(StatusCode::OK, "OK"),
        (Method::GET, "/route") => route(&state, req.uri().query().unwrap_or("")),
        (_, "/route") => text(StatusCode::METHOD_NOT_ALLOWED, "Method not allowed"),
        (Method::POST, JOIN_PATH) => match read_body(req).await {
            Ok(body) => join(&state, &body).await,
            Err(error) => error.into_response(),
        },
        (Method::POST, DONE_PATH) => match read_body(req).await {
            Ok(body) => done(&state, &body).await,
            Err(error) => error.into_response(),
        },
        _ => ApiError::new(StatusCode::NOT_FOUND, format!("no route for {path}")).into_response(),
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<ResponseBody> {
    bytes_response(
        status,
        "text/plain; charset=utf-8",
        Bytes::from_static(body.as_bytes()),
    )
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map(|collected| collected.to_bytes())
        .map_err(|e| ApiError::bad_request(format!("cannot read request body: {e}")))
}

/// `GET /route?prefill_dp_rank=D&prefill_cp_rank=C&target_tp_rank=T&target_pp_rank=P`: with
/// every rank `-1` the prefill engine's layout, else where rank `(D, C, T, P)` handshakes.
fn route(state: &EngineState, query: &str) -> Response<ResponseBody> {
    let rank = |name: &str| {
        query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(key, _)| *key == name)
            .and_then(|(_, value)| value.parse::<i64>().ok())
    };
    let (Some(dp), Some(cp), Some(tp), Some(pp)) = (
        rank("prefill_dp_rank"),
        rank("prefill_cp_rank"),
        rank("target_tp_rank"),
        rank("target_pp_rank"),
    ) else {
        return text(
            StatusCode::BAD_REQUEST,
            "Missing inputs for bootstrap server.",
        );
    };
    let config = &state.config;
    let port = config.kv_transfer.sglang.bootstrap_port;
    if [dp, cp, tp, pp] == [-1; 4] {
        let info = PrefillServerInfo {
            attn_tp_size: 1,
            attn_cp_size: 1,
            dp_size: state.ranks.len(),
            pp_size: 1,
            page_size: config.block_size,
            kv_cache_dtype: "auto".to_owned(),
            follow_bootstrap_room: true,
            enable_dsa_cache_layer_split: false,
            prefill_http_port: state.side_channel.1,
        };
        return json_response(StatusCode::OK, &info);
    }
    let known = usize::try_from(dp).is_ok_and(|dp| dp < state.ranks.len());
    if !known || [cp, tp, pp] != [0; 3] {
        let message = format!(
            "Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}"
        );
        return bytes_response(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            message.into(),
        );
    }
    let info = PrefillRankInfo {
        rank_ip: state.side_channel.0.clone(),
        rank_port: port,
    };
    json_response(StatusCode::OK, &info)
}

/// A decode engine joins a room: answered with the room's KV once the prefill ran, 504 when
/// none came in the time it waits.
async fn join(state: &EngineState, body: &[u8]) -> Response<ResponseBody> {
    let request: JoinRequest = match parse_json(body) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    let room = request.bootstrap_room;
    let wait = Duration::from_millis(request.wait_ms);
    match state.rooms.join(room, wait).await {
        Ok(kv) => json_response(StatusCode::OK, &kv),
        Err(JoinError::TimedOut) => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            format!(
                "no prefill of room {room} within {:.1}s",
                wait.as_secs_f64()
            ),
        )
        .into_response(),
        Err(JoinError::Taken) => ApiError::new(
            StatusCode::CONFLICT,
            format!("another decode engine joined room {room}"),
        )
        .into_response(),
        Err(JoinError::Failed(why)) => {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, why).into_response()
        }
    }
}

/// A decode engine has a room's KV: its blocks are freed, and the prefill leg answers.
async fn done(state: &EngineState, body: &[u8]) -> Response<ResponseBody> {
    let request: DoneRequest = match parse_json(body) {
        Ok(request) => request,
        Err(error) => return error.into_response(),
    };
    let room = request.bootstrap_room;
    let mut blocks = 0;
    for rank in &state.ranks {
        match rank
            .scheduler
            .read_held(Some(hold_id(room)), Vec::new())
            .await
        {
            Ok(Some(freed)) => {
                blocks = freed;
                break;
            }
            Ok(None) => {}
            Err(gone) => {
                return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, gone.to_string())
                    .into_response();
            }
        }
    }
    if !state.rooms.transferred(room) {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no KV of room {room} waits here"),
        )
        .into_response();
    }
    json_response(StatusCode::OK, &json!({ "blocks": blocks }))
}

//! Path/method dispatch, body reading, test hooks and the `x-engine-id` header.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ALLOW, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::body::ResponseBody;
use super::dp_rank::RequestedRank;
use super::error::ApiError;
use super::openai::Endpoint;
use super::state::EngineState;
use super::{
    embeddings, info, kv_event_sources, kv_faults, kv_read, lora, openai, responses, sglang,
    tokenize, transcription,
};
use crate::kv_transfer::pull::READ_PATH;

/// Largest accepted request body.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;
/// Test hook: delay the response headers by this many milliseconds.
pub(crate) const DELAY_HEADER: &str = "x-sim-delay-ms";
/// Test hook: answer this HTTP status with an OpenAI-shaped error body.
pub(crate) const STATUS_HEADER: &str = "x-sim-status";
/// Names the engine on every response.
const ENGINE_ID_HEADER: &str = "x-engine-id";
/// W3C trace context fields of a request, echoed (test hook) as [`ECHOED_TRACE_HEADERS`].
const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];
/// Test hook: the request's `traceparent` / `tracestate`, as the engine received them.
const ECHOED_TRACE_HEADERS: [&str; 2] = ["x-sim-traceparent", "x-sim-tracestate"];

#[derive(Debug, Clone, Copy)]
enum Route {
    Completions,
    Chat,
    Responses,
    Embeddings,
    Tokenize,
    Transcription,
    Generate,
    ResetPrefixCache,
    KvFaults,
    KvEventSources,
    KvRead,
    Traceparents,
    LoadLora,
    UnloadLora,
    Models,
    Health,
    Metrics,
    ServerInfo,
    ModelInfo,
}

impl Route {
    /// Whether the route runs a generation (the config's fault hooks apply to it).
    fn generates(self) -> bool {
        matches!(
            self,
            Self::Completions | Self::Chat | Self::Responses | Self::Generate
        )
    }
}

fn lookup(path: &str) -> Option<(Route, &'static str)> {
    Some(match path {
        "/v1/completions" => (Route::Completions, "POST"),
        "/v1/chat/completions" => (Route::Chat, "POST"),
        "/v1/responses" => (Route::Responses, "POST"),
        "/v1/embeddings" => (Route::Embeddings, "POST"),
        "/tokenize" => (Route::Tokenize, "POST"),
        "/v1/audio/transcriptions" => (Route::Transcription, "POST"),
        "/generate" => (Route::Generate, "POST"),
        "/reset_prefix_cache" => (Route::ResetPrefixCache, "POST"),
        "/sim/kv_events/faults" => (Route::KvFaults, "POST"),
        "/kv_event_sources" => (Route::KvEventSources, "GET"),
        READ_PATH => (Route::KvRead, "POST"),
        "/sim/traceparents" => (Route::Traceparents, "GET"),
        "/v1/load_lora_adapter" => (Route::LoadLora, "POST"),
        "/v1/unload_lora_adapter" => (Route::UnloadLora, "POST"),
        "/v1/models" => (Route::Models, "GET"),
        "/health" | "/healthz" | "/readiness" | "/health_generate" => (Route::Health, "GET"),
        "/metrics" => (Route::Metrics, "GET"),
        "/get_server_info" | "/server_info" => (Route::ServerInfo, "GET"),
        "/get_model_info" | "/model_info" => (Route::ModelInfo, "GET"),
        _ => return None,
    })
}

/// Answers one request; never fails.
pub(crate) async fn handle(
    state: Arc<EngineState>,
    req: Request<Incoming>,
) -> Response<ResponseBody> {
    let trace = TRACE_HEADERS.map(|name| req.headers().get(name).cloned());
    let mut res = match route(&state, req).await {
        Ok(res) => res,
        Err(e) => e.into_response(),
    };
    let headers = res.headers_mut();
    headers.insert(ENGINE_ID_HEADER, state.engine_id.clone());
    for (name, value) in ECHOED_TRACE_HEADERS.into_iter().zip(trace) {
        if let Some(value) = value {
            headers.insert(name, value);
        }
    }
    res
}

async fn route(
    state: &Arc<EngineState>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, ApiError> {
    apply_test_hooks(&req).await?;
    let path = req.uri().path();
    let Some((route, method)) = lookup(path) else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no route for {path}"),
        ));
    };
    if req.method().as_str() != method {
        let mut res = ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{} {path} is not allowed", req.method()),
        )
        .into_response();
        res.headers_mut()
            .insert(ALLOW, HeaderValue::from_static(method));
        return Ok(res);
    }
    if route.generates() {
        if let Some(traceparent) = req.headers().get(TRACE_HEADERS[0]) {
            state.saw_traceparent(&String::from_utf8_lossy(traceparent.as_bytes()));
        }
        apply_config_hooks(state).await?;
    }
    let dp_rank = RequestedRank::from_headers(req.headers());
    Ok(match route {
        Route::Completions => {
            let body = read_body(req).await?;
            openai::handle(state.clone(), Endpoint::Completions, body, dp_rank).await
        }
        Route::Chat => {
            let body = read_body(req).await?;
            openai::handle(state.clone(), Endpoint::Chat, body, dp_rank).await
        }
        Route::Responses => responses::handle(state.clone(), read_body(req).await?).await,
        Route::Embeddings => embeddings::handle(state, &read_body(req).await?),
        Route::Tokenize => tokenize::handle(state, &read_body(req).await?),
        Route::Transcription => transcription::handle(state, req).await?,
        Route::Generate => sglang::handle(state.clone(), read_body(req).await?).await,
        Route::ResetPrefixCache => info::reset_prefix_cache(state.clone()).await,
        Route::KvFaults => {
            let body = read_body(req).await?;
            kv_faults::handle(state.clone(), body, dp_rank).await
        }
        Route::KvRead => kv_read::handle(state.clone(), read_body(req).await?).await,
        Route::KvEventSources => kv_event_sources::handle(state),
        Route::Traceparents => info::traceparents(state),
        Route::LoadLora => lora::load(state, &read_body(req).await?),
        Route::UnloadLora => lora::unload(state, &read_body(req).await?),
        Route::Models => info::models(state),
        Route::Health => info::health(),
        Route::Metrics => info::metrics(state),
        Route::ServerInfo => info::server_info(state),
        Route::ModelInfo => info::model_info(state),
    })
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body exceeds {MAX_BODY_BYTES} bytes"),
            ))
        }
        Err(e) => Err(ApiError::bad_request(format!(
            "cannot read request body: {e}"
        ))),
    }
}

/// The config's test hooks for generation requests: `--head-delay-ms`, then `--fail-status`.
async fn apply_config_hooks(state: &EngineState) -> Result<(), ApiError> {
    if !state.config.head_delay.is_zero() {
        tokio::time::sleep(state.config.head_delay).await;
    }
    match state
        .config
        .fail_status
        .and_then(|s| StatusCode::from_u16(s).ok())
    {
        Some(status) => Err(ApiError::new(
            status,
            format!("simulated failure (--fail-status {})", status.as_u16()),
        )),
        None => Ok(()),
    }
}

/// Test-only hooks: `x-sim-delay-ms: N` sleeps N ms before answering; `x-sim-status: CODE`
/// answers CODE with an OpenAI-shaped error body instead of handling the request.
async fn apply_test_hooks<B>(req: &Request<B>) -> Result<(), ApiError> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .map(|v| v.to_str().unwrap_or("").trim().to_owned())
    };
    if let Some(delay) = header(DELAY_HEADER) {
        let ms: u64 = delay.parse().map_err(|_| {
            ApiError::bad_request(format!("{DELAY_HEADER} must be a number of milliseconds"))
        })?;
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(status) = header(STATUS_HEADER) {
        let status = status
            .parse::<u16>()
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| {
                ApiError::bad_request(format!("{STATUS_HEADER} must be an HTTP status code"))
            })?;
        return Err(ApiError::new(
            status,
            format!("simulated error ({STATUS_HEADER}: {})", status.as_u16()),
        ));
    }
    Ok(())
}

//! vLLM's runtime LoRA endpoints (served by vLLM with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, by
//! the simulator always):
//! - `POST /v1/load_lora_adapter` with `{"lora_name", "lora_path", "load_inplace"?}`;
//! - `POST /v1/unload_lora_adapter` with `{"lora_name", "lora_int_id"?}` (the id is ignored, as
//!   vLLM ignores it).
//!
//! Success is 200 with vLLM's plain-text message; refusals are OpenAI-shaped errors with vLLM's
//! status, `type` and message (see [`LoraError`]).

use bytes::Bytes;
use http::{Response, StatusCode};
use serde::Deserialize;

use super::body::{ResponseBody, bytes_response};
use super::error::ApiError;
use super::generation::parse_json;
use super::state::EngineState;
use crate::lora::LoraError;

/// `POST /v1/load_lora_adapter` body.
#[derive(Debug, Deserialize)]
struct LoadRequest {
    lora_name: String,
    lora_path: String,
    #[serde(default)]
    load_inplace: bool,
}

/// `POST /v1/unload_lora_adapter` body (`lora_int_id`, when sent, is not read).
#[derive(Debug, Deserialize)]
struct UnloadRequest {
    lora_name: String,
}

/// Handles `POST /v1/load_lora_adapter`.
pub(crate) fn load(state: &EngineState, body: &[u8]) -> Response<ResponseBody> {
    let result = parse_json::<LoadRequest>(body).and_then(|req| {
        state
            .loras
            .load(&req.lora_name, &req.lora_path, req.load_inplace)
            .map_err(api_error)?;
        tracing::info!(name = %req.lora_name, path = %req.lora_path, "loaded LoRA adapter");
        Ok(format!(
            "Success: LoRA adapter '{}' added successfully.",
            req.lora_name
        ))
    });
    respond(result)
}

/// Handles `POST /v1/unload_lora_adapter`.
pub(crate) fn unload(state: &EngineState, body: &[u8]) -> Response<ResponseBody> {
    let result = parse_json::<UnloadRequest>(body).and_then(|req| {
        state.loras.unload(&req.lora_name).map_err(api_error)?;
        tracing::info!(name = %req.lora_name, "unloaded LoRA adapter");
        Ok(format!(
            "Success: LoRA adapter '{}' removed successfully.",
            req.lora_name
        ))
    });
    respond(result)
}

fn respond(result: Result<String, ApiError>) -> Response<ResponseBody> {
    match result {
        Ok(message) => bytes_response(
            StatusCode::OK,
            "text/plain; charset=utf-8",
            Bytes::from(message),
        ),
        Err(e) => e.into_response(),
    }
}

/// vLLM's status and error `type` for each refusal.
fn api_error(e: LoraError) -> ApiError {
    let message = e.to_string();
    match e {
        LoraError::NotEnabled => ApiError::bad_request(message),
        LoraError::MissingNameOrPath | LoraError::AlreadyLoaded(_) | LoraError::MissingName => {
            ApiError::bad_request(message).with_type("InvalidUserInput")
        }
        LoraError::NotFound(_) => ApiError::new(StatusCode::NOT_FOUND, message),
    }
}

//! `POST /v1/embeddings`: deterministic unit vectors, computed inline (no scheduling).

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};

use super::body::{ResponseBody, json_response};
use super::error::ApiError;
use super::generation::{model_name, resolve_model, tokenize_prompts};
use super::state::{EngineState, unix_now};
use crate::embedding::{embed, to_base64};
use crate::protocol::requests::EmbeddingRequest;
use crate::protocol::responses::{EmbeddingData, EmbeddingList, EmbeddingValue, Usage};

/// Handles one embeddings request.
pub(crate) fn handle(state: &Arc<EngineState>, body: &Bytes) -> Response<ResponseBody> {
    run(state, body).unwrap_or_else(ApiError::into_response)
}

fn run(state: &EngineState, body: &[u8]) -> Result<Response<ResponseBody>, ApiError> {
    let req: EmbeddingRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    let lora = resolve_model(state, req.model.as_deref())?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "unsupported encoding_format `{other}` (float or base64)"
            ))
            .with_param("encoding_format"));
        }
    };
    let inputs = tokenize_prompts(state, req.input, true, "input")?;
    let mut usage = Usage::default();
    let mut data = Vec::with_capacity(inputs.len());
    for (index, tokens) in inputs.iter().enumerate() {
        if tokens.is_empty() {
            return Err(ApiError::bad_request("The input cannot be empty.").with_param("input"));
        }
        if tokens.len() > state.config.max_model_len {
            return Err(ApiError::bad_request(format!(
                "This model's maximum context length is {} tokens. However, you requested {} tokens in the input for embedding generation. Please reduce the length of the input.",
                state.config.max_model_len,
                tokens.len()
            ))
            .with_param("input"));
        }
        usage.add(tokens.len(), 0, 0);
        let vector = embed(tokens, state.config.embedding_dim);
        let embedding = if base64 {
            EmbeddingValue::Base64(to_base64(&vector))
        } else {
            EmbeddingValue::Floats(vector)
        };
        data.push(EmbeddingData {
            object: "embedding",
            index,
            embedding,
        });
    }
    let id = state.response_id("embd-");
    let list = EmbeddingList {
        id: &id,
        object: "list",
        created: unix_now(),
        model: model_name(state, lora.as_ref()),
        data,
        usage,
    };
    Ok(json_response(StatusCode::OK, &list))
}

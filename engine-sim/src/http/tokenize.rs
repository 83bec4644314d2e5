//! `POST /tokenize`, as vLLM answers it: a completions prompt (`{"model","prompt",
//! "add_special_tokens"}`, special tokens added by default) or a chat (`{"model","messages",
//! "add_generation_prompt","continue_final_message","add_special_tokens"}`, rendered with
//! the simulator's ChatML template, no special tokens added by default), tokenized with the
//! engine's tokenizer (`--tokenizer`, else the built-in one); the answer is
//! `{"count","max_model_len","tokens","token_strs"}` (`token_strs` always null here).

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use serde::{Deserialize, Serialize};

use super::body::{ResponseBody, json_response};
use super::error::ApiError;
use super::generation::{parse_json, resolve_model, tokenize_chat_ending};
use super::state::EngineState;
use crate::chat_template::Ending;
use crate::protocol::requests::ChatRequest;

/// The fields that tell a chat from a completions prompt, and the flag both share.
#[derive(Debug, Deserialize)]
struct Shape {
    model: Option<String>,
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<serde::de::IgnoredAny>,
    add_special_tokens: Option<bool>,
}

/// vLLM's `TokenizeResponse`.
#[derive(Debug, Serialize)]
struct Tokenized {
    count: usize,
    max_model_len: usize,
    tokens: Vec<u32>,
    token_strs: Option<Vec<String>>,
}

/// Answers one `/tokenize` request.
pub(crate) fn handle(state: &Arc<EngineState>, body: &Bytes) -> Response<ResponseBody> {
    match tokenize(state, body) {
        Ok(tokens) => json_response(
            StatusCode::OK,
            &Tokenized {
                count: tokens.len(),
                max_model_len: state.config.max_model_len,
                tokens,
                token_strs: None,
            },
        ),
        Err(error) => error.into_response(),
    }
}

fn tokenize(state: &EngineState, body: &[u8]) -> Result<Vec<u32>, ApiError> {
    let shape: Shape = parse_json(body)?;
    resolve_model(state, shape.model.as_deref())?;
    if shape.messages.is_some() {
        let request: ChatRequest = parse_json(body)?;
        let messages = request.chat_messages()?;
        let ending = Ending::from_request(
            request.add_generation_prompt,
            request.continue_final_message,
            &messages,
        )
        .map_err(|message| ApiError::bad_request(message).with_param("messages"))?;
        let mut ids = tokenize_chat_ending(state, &messages, ending, "messages")?;
        if shape.add_special_tokens == Some(true) {
            let special = encode(state, "", true)?;
            ids.splice(0..0, special);
        }
        return Ok(ids);
    }
    let Some(prompt) = shape.prompt else {
        return Err(ApiError::bad_request(
            "a /tokenize request needs `prompt` (a string) or `messages`",
        )
        .with_param("prompt"));
    };
    encode(state, &prompt, shape.add_special_tokens.unwrap_or(true))
}

fn encode(state: &EngineState, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
    state
        .tokenizer
        .encode(text, add_special_tokens)
        .map_err(|message| ApiError::bad_request(message).with_param("prompt"))
}

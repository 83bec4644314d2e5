//! SGLang's `POST /generate` (minimal): `text` or `input_ids`, `sampling_params.max_new_tokens`,
//! `stop`, `stream` (cumulative text per chunk, single prompt only).

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::{Response, StatusCode};

use super::body::{ResponseBody, json_response};
use super::dp_rank::RankChoice;
use super::error::ApiError;
use super::generation::{collect, submit, tokenize_prompts, validate_lengths};
use super::openai::sse_response;
use super::sglang_pd::PdLeg;
use super::sse::{SseBody, StreamFormatter, write_data, write_raw};
use super::state::EngineState;
use crate::protocol::prompt::PromptInput;
use crate::protocol::requests::{GenParams, GenerateRequest};
use crate::protocol::responses::{GenerateMeta, GenerateOut, SglFinish};
use crate::scheduler::{SeqEvent, SeqOutcome};

/// Handles one `/generate` request.
pub(crate) async fn handle(state: Arc<EngineState>, body: Bytes) -> Response<ResponseBody> {
    let arrival = Instant::now();
    match run(state, &body, arrival).await {
        Ok(res) => res,
        Err(e) => e.into_response(),
    }
}

fn finish_of(o: &SeqOutcome) -> SglFinish<'_> {
    match o.stop.as_deref() {
        Some(matched) => SglFinish {
            kind: "stop",
            length: None,
            matched: Some(matched),
        },
        None => SglFinish {
            kind: o.finish.as_str(),
            length: Some(o.completion_tokens),
            matched: None,
        },
    }
}

async fn run(
    state: Arc<EngineState>,
    body: &[u8],
    arrival: Instant,
) -> Result<Response<ResponseBody>, ApiError> {
    let req: GenerateRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    let (input, batch) = match (req.text, req.input_ids) {
        (Some(t @ PromptInput::Text(_)), None) => (t, false),
        (Some(t @ PromptInput::Texts(_)), None) => (t, true),
        (None, Some(ids @ PromptInput::Tokens(_))) => (ids, false),
        (None, Some(ids @ PromptInput::TokenLists(_))) => (ids, true),
        _ => {
            return Err(ApiError::bad_request(
                "exactly one of `text` (string or list of strings) or `input_ids` (ids or list of id lists) is required",
            ));
        }
    };
    let mut params = GenParams::sglang(req.sampling_params.unwrap_or_default(), req.stream)?;
    if batch && params.stream {
        return Err(
            ApiError::bad_request("streaming a batch is not supported by the simulator")
                .with_param("stream"),
        );
    }
    let prompts = tokenize_prompts(&state, input, true, "text")?;
    let prompt_tokens = prompts.first().map_or(0, Vec::len);
    let count = prompts.len();
    validate_lengths(&state, &prompts, params.max_tokens)?;
    let id = state.response_id("sgl-");
    // SGLang's disaggregation (`--disaggregation-mode`).
    let pd = PdLeg::of(&state, body, count, &id)?;
    params = pd.params(params);
    let mut rank = RankChoice::Balanced;
    let prompt = prompts.first().map(Vec::as_slice);
    let handoff = pd
        .handoff(&state, &mut rank, prompt, None, None, &id)
        .await?;
    let rx = submit(&state, prompts, &params, None, arrival, handoff, rank)?;
    let rx = pd.deliver(&state, rx, count, &id).await?;
    if params.stream {
        let formatter = GenerateStream {
            id,
            text: String::new(),
            prompt_tokens,
            tokens: 0,
        };
        return Ok(sse_response(SseBody::new(rx, 1, Box::new(formatter))));
    }
    let outcomes = collect(rx, count).await?;
    let outs: Vec<GenerateOut<'_>> = outcomes
        .iter()
        .map(|o| GenerateOut {
            text: &o.text,
            meta_info: GenerateMeta {
                id: &id,
                finish_reason: Some(finish_of(o)),
                prompt_tokens: o.prompt_tokens,
                completion_tokens: o.completion_tokens,
                cached_tokens: o.cached_tokens,
            },
        })
        .collect();
    Ok(if batch {
        json_response(StatusCode::OK, &outs)
    } else {
        json_response(StatusCode::OK, &outs[0])
    })
}

/// SGLang streaming: every chunk carries the whole text so far.
#[derive(Debug)]
struct GenerateStream {
    id: String,
    text: String,
    prompt_tokens: usize,
    tokens: usize,
}

impl StreamFormatter for GenerateStream {
    fn event(&mut self, event: SeqEvent, out: &mut BytesMut) {
        match event {
            SeqEvent::Delta { text, .. } => {
                self.tokens += 1;
                self.text.push_str(&text);
                let meta = GenerateMeta {
                    id: &self.id,
                    finish_reason: None,
                    prompt_tokens: self.prompt_tokens,
                    completion_tokens: self.tokens,
                    cached_tokens: 0,
                };
                write_data(
                    out,
                    &GenerateOut {
                        text: &self.text,
                        meta_info: meta,
                    },
                );
            }
            SeqEvent::Finished(o) => {
                self.text.push_str(&o.text);
                let meta = GenerateMeta {
                    id: &self.id,
                    finish_reason: Some(finish_of(&o)),
                    prompt_tokens: o.prompt_tokens,
                    completion_tokens: o.completion_tokens,
                    cached_tokens: o.cached_tokens,
                };
                write_data(
                    out,
                    &GenerateOut {
                        text: &self.text,
                        meta_info: meta,
                    },
                );
            }
            SeqEvent::Failed { message, .. } => {
                write_raw(
                    out,
                    &ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).body_json(),
                );
            }
        }
    }

    fn finish(&mut self, _out: &mut BytesMut) {}
}

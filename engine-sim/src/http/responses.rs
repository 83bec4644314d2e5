//! `POST /v1/responses`: the OpenAI Responses API, rendered like a chat and scheduled through
//! the same cache and batching as the other endpoints.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::{Response, StatusCode};

use super::body::{ResponseBody, json_response};
use super::dp_rank::RankChoice;
use super::error::ApiError;
use super::generation::{
    collect, model_name, parse_json, resolve_model, submit, tokenize_chat, validate_lengths,
};
use super::openai::sse_response;
use super::sglang_pd::PdLeg;
use super::sse::{SseBody, StreamFormatter, write_event};
use super::state::{EngineState, unix_now};
use crate::lora::Lora;
use crate::protocol::requests::GenParams;
use crate::protocol::responses_api::{
    OutputMessage, OutputText, ResponseObject, ResponseUsage, ResponsesRequest, Sequenced,
    StreamEvent, TextLocation,
};
use crate::scheduler::SeqEvent;

/// What a response object repeats from its request.
#[derive(Debug)]
struct ResponseMeta {
    id: String,
    item_id: String,
    created_at: u64,
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
}

impl ResponseMeta {
    /// The response object; `done` carries the final text and usage.
    fn object<'a>(
        &'a self,
        model: &'a str,
        done: Option<(&'a str, ResponseUsage)>,
    ) -> ResponseObject<'a> {
        ResponseObject {
            id: &self.id,
            object: "response",
            created_at: self.created_at,
            model,
            status: if done.is_some() {
                "completed"
            } else {
                "in_progress"
            },
            error: None,
            incomplete_details: None,
            instructions: self.instructions.as_deref(),
            max_output_tokens: self.max_output_tokens,
            output: done
                .map(|(text, _)| OutputMessage::assistant(&self.item_id, Some(text)))
                .into_iter()
                .collect(),
            usage: done.map(|(_, usage)| usage),
        }
    }

    /// The place of the only text part.
    fn location(&self) -> TextLocation<'_> {
        TextLocation {
            item_id: &self.item_id,
            output_index: 0,
            content_index: 0,
        }
    }
}

/// Handles one Responses API request.
pub(crate) async fn handle(state: Arc<EngineState>, body: Bytes) -> Response<ResponseBody> {
    let arrival = Instant::now();
    match run(state, &body, arrival).await {
        Ok(res) => res,
        Err(e) => e.into_response(),
    }
}

async fn run(
    state: Arc<EngineState>,
    body: &[u8],
    arrival: Instant,
) -> Result<Response<ResponseBody>, ApiError> {
    let req: ResponsesRequest = parse_json(body)?;
    let lora = resolve_model(&state, req.model.as_deref())?;
    let messages = req.chat_messages()?;
    let params = GenParams::responses(req.max_output_tokens, req.stream)?;
    let prompts = vec![tokenize_chat(&state, &messages, "input")?];
    validate_lengths(&state, &prompts, params.max_tokens)?;
    let id = state.response_id("resp_");
    // SGLang's disaggregation (`--disaggregation-mode`), as for chat.
    let pd = PdLeg::of(&state, body, 1, &id)?;
    let params = pd.params(params);
    // vLLM 0.32's Responses API does not read `X-data-parallel-rank`.
    let mut rank = RankChoice::Balanced;
    let prompt = prompts.first().map(Vec::as_slice);
    let handoff = pd
        .handoff(&state, &mut rank, prompt, lora.as_ref(), None, &id)
        .await?;
    let rx = submit(
        &state,
        prompts,
        &params,
        lora.as_ref(),
        arrival,
        handoff,
        rank,
    )?;
    let rx = pd.deliver(&state, rx, 1, &id).await?;
    let meta = ResponseMeta {
        id,
        item_id: state.response_id("msg_"),
        created_at: unix_now(),
        instructions: req.instructions,
        max_output_tokens: req.max_output_tokens.map(|_| params.max_tokens),
    };
    if params.stream {
        let stream = ResponsesStream {
            state: state.clone(),
            lora,
            meta,
            sequence_number: 0,
            started: false,
            failed: false,
            text: String::new(),
            usage: ResponseUsage::default(),
        };
        return Ok(sse_response(SseBody::new(rx, 1, Box::new(stream))));
    }
    let outcome = collect(rx, 1)
        .await?
        .pop()
        .ok_or_else(|| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the sequence vanished"))?;
    let usage = ResponseUsage::new(
        outcome.prompt_tokens,
        outcome.cached_tokens,
        outcome.completion_tokens,
    );
    Ok(json_response(
        StatusCode::OK,
        &meta.object(
            model_name(&state, lora.as_ref()),
            Some((&outcome.text, usage)),
        ),
    ))
}

/// The Responses API event stream: `response.created`, `response.in_progress`, the output
/// item and content part openers, one `response.output_text.delta` per generated token, then
/// the closers and `response.completed`. No `[DONE]`.
#[derive(Debug)]
struct ResponsesStream {
    state: Arc<EngineState>,
    lora: Option<Lora>,
    meta: ResponseMeta,
    sequence_number: u64,
    started: bool,
    failed: bool,
    text: String,
    usage: ResponseUsage,
}

/// Writes `event` numbered `*sequence_number` and advances the number.
fn emit(out: &mut BytesMut, sequence_number: &mut u64, event: StreamEvent<'_>) {
    let name = event.name();
    let sequenced = Sequenced {
        event,
        sequence_number: *sequence_number,
    };
    write_event(out, name, &sequenced);
    *sequence_number += 1;
}

impl ResponsesStream {
    /// The opening events, sent with the first token (after the simulated prefill).
    fn start(&mut self, out: &mut BytesMut) {
        if self.started {
            return;
        }
        self.started = true;
        let model = model_name(&self.state, self.lora.as_ref());
        let meta = &self.meta;
        let events = [
            StreamEvent::Created {
                response: meta.object(model, None),
            },
            StreamEvent::InProgress {
                response: meta.object(model, None),
            },
            StreamEvent::OutputItemAdded {
                output_index: 0,
                item: OutputMessage::assistant(&meta.item_id, None),
            },
            StreamEvent::ContentPartAdded {
                at: meta.location(),
                part: OutputText::new(""),
            },
        ];
        for event in events {
            emit(out, &mut self.sequence_number, event);
        }
    }

    fn delta(&mut self, out: &mut BytesMut, text: &str) {
        if text.is_empty() {
            return;
        }
        self.text.push_str(text);
        let event = StreamEvent::OutputTextDelta {
            at: self.meta.location(),
            delta: text,
            logprobs: [],
        };
        emit(out, &mut self.sequence_number, event);
    }
}

impl StreamFormatter for ResponsesStream {
    fn event(&mut self, event: SeqEvent, out: &mut BytesMut) {
        match event {
            SeqEvent::Delta { text, .. } => {
                self.start(out);
                self.delta(out, &text);
            }
            SeqEvent::Finished(o) => {
                self.start(out);
                self.delta(out, &o.text);
                self.usage =
                    ResponseUsage::new(o.prompt_tokens, o.cached_tokens, o.completion_tokens);
            }
            SeqEvent::Failed { message, .. } => {
                self.failed = true;
                let event = StreamEvent::Error {
                    code: None,
                    message: &message,
                    param: None,
                };
                emit(out, &mut self.sequence_number, event);
            }
        }
    }

    fn finish(&mut self, out: &mut BytesMut) {
        if self.failed {
            return;
        }
        let model = model_name(&self.state, self.lora.as_ref());
        let meta = &self.meta;
        let text = self.text.as_str();
        let events = [
            StreamEvent::OutputTextDone {
                at: meta.location(),
                text,
                logprobs: [],
            },
            StreamEvent::ContentPartDone {
                at: meta.location(),
                part: OutputText::new(text),
            },
            StreamEvent::OutputItemDone {
                output_index: 0,
                item: OutputMessage::assistant(&meta.item_id, Some(text)),
            },
            StreamEvent::Completed {
                response: meta.object(model, Some((text, self.usage))),
            },
        ];
        for event in events {
            emit(out, &mut self.sequence_number, event);
        }
    }

    fn done_marker(&self) -> bool {
        false
    }
}

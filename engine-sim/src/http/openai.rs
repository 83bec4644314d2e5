//! `POST /v1/completions` and `POST /v1/chat/completions`.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};

use super::body::{ResponseBody, bytes_response, json_response};
use super::dp_rank::{RankChoice, RequestedRank, streamed_error};
use super::error::ApiError;
use super::generation::{
    add_usage, cached_blocks, collect, model_name, parse_json, resolve_model, submit,
    tokenize_chat_ending, tokenize_prompts, validate_lengths,
};
use super::sglang_pd::PdLeg;
use super::sse::{SseBody, StreamFormatter, write_data, write_raw};
use super::state::{EngineState, unix_now};
use crate::chat_template::Ending;
use crate::config::DisaggregationMode;
use crate::kv_transfer::params::{KvTransferParams, PrefillCounts, RemotePrefill};
use crate::lora::Lora;
use crate::protocol::prompt::PromptInput;
use crate::protocol::requests::{
    ChatRequest, CompletionRequest, GenParams, non_empty_conversation,
};
use crate::protocol::responses::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatDelta, ChatMessageOut, Completion,
    CompletionChoice, Usage,
};
use crate::scheduler::{Handoff, SeqEvent};

/// Which OpenAI endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// Handles one completions or chat request, on the data-parallel rank `dp_rank` names (its
/// `X-data-parallel-rank` header) or the one the DP load balancer picks.
pub(crate) async fn handle(
    state: Arc<EngineState>,
    endpoint: Endpoint,
    body: Bytes,
    dp_rank: Option<RequestedRank>,
) -> Response<ResponseBody> {
    let arrival = Instant::now();
    match run(state, endpoint, &body, dp_rank, arrival).await {
        Ok(res) => res,
        Err(e) => e.into_response(),
    }
}

async fn run(
    state: Arc<EngineState>,
    endpoint: Endpoint,
    body: &[u8],
    dp_rank: Option<RequestedRank>,
    arrival: Instant,
) -> Result<Response<ResponseBody>, ApiError> {
    let (prompts, params, lora, transfer, echo) = match endpoint {
        Endpoint::Completions => {
            let req: CompletionRequest = parse_json(body)?;
            let lora = resolve_model(&state, req.model.as_deref())?;
            let echo = echoed_prompt(&req)?;
            let params = GenParams::openai(
                req.max_tokens,
                req.stream,
                req.stream_options.as_ref(),
                req.stop,
                req.n,
            )?
            .with_cache_salt(req.cache_salt)?;
            (
                tokenize_prompts(&state, req.prompt, true, "prompt")?,
                params,
                lora,
                req.kv_transfer_params,
                echo,
            )
        }
        Endpoint::Chat => {
            let req: ChatRequest = parse_json(body)?;
            let lora = resolve_model(&state, req.model.as_deref())?;
            let messages = req.chat_messages()?;
            non_empty_conversation(&messages)?;
            let ending = Ending::from_request(
                req.add_generation_prompt,
                req.continue_final_message,
                &messages,
            )
            .map_err(|message| ApiError::bad_request(message).with_param("messages"))?;
            let max_tokens = req.max_tokens();
            let params = GenParams::openai(
                max_tokens,
                req.stream,
                req.stream_options.as_ref(),
                req.stop,
                req.n,
            )?
            .with_cache_salt(req.cache_salt)?;
            (
                vec![tokenize_chat_ending(&state, &messages, ending, "messages")?],
                params,
                lora,
                req.kv_transfer_params,
                None,
            )
        }
    };
    let count = prompts.len() * params.n;
    let leg = Leg::of(&state, transfer.as_ref(), &params, count)?;
    validate_lengths(&state, &prompts, params.max_tokens)?;
    // vLLM checks the rank after the prompt, when the request reaches its engine client.
    let mut rank = match dp_rank.map(|r| r.check(state.ranks.len())).transpose() {
        Ok(Some(rank)) => RankChoice::Fixed(rank),
        Ok(None) => RankChoice::Balanced,
        Err(error) if params.stream => {
            return Ok(bytes_response(
                StatusCode::OK,
                "text/event-stream",
                Bytes::from(streamed_error(&error)),
            ));
        }
        Err(error) => return Err(error),
    };
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl-",
        Endpoint::Chat => "chatcmpl-",
    };
    let id = state.response_id(prefix);
    // SGLang's disaggregation, checked where SGLang's scheduler checks it.
    let pd = PdLeg::of(&state, body, count, &id)?;
    let params = pd.params(params);
    let handoff = match &leg {
        Leg::Plain => {
            let prompt = prompts.first().map(Vec::as_slice);
            let salt = params.cache_salt.as_deref();
            pd.handoff(&state, &mut rank, prompt, lora.as_ref(), salt, &id)
                .await?
        }
        Leg::Prefill => Handoff::Hold(id.clone()),
        Leg::Decode(remote) => {
            // The pull lands on one core: place the leg (one sequence) before pulling.
            let core = match rank {
                RankChoice::Fixed(core) => core,
                RankChoice::Balanced => state.balanced_rank(),
            };
            rank = RankChoice::Fixed(core);
            let cached = match prompts.first() {
                Some(prompt) => {
                    let salt = params.cache_salt.as_deref();
                    cached_blocks(&state, core, prompt, lora.as_ref(), salt).await?
                }
                None => 0,
            };
            let core = state.rank(core);
            match core.puller.pull(remote, cached, &core.metrics).await {
                Some(blocks) => Handoff::Pulled(blocks * state.config.block_size),
                None => Handoff::None,
            }
        }
    };

    let rx = submit(
        &state,
        prompts,
        &params,
        lora.as_ref(),
        arrival,
        handoff,
        rank,
    )?;
    let rx = pd.deliver(&state, rx, count, &id).await?;
    let created = unix_now();
    if params.stream {
        let formatter: Box<dyn StreamFormatter> = match endpoint {
            Endpoint::Completions => Box::new(CompletionStream::new(
                state.clone(),
                lora,
                id,
                created,
                &params,
                echo,
                count,
            )),
            Endpoint::Chat => Box::new(ChatStream::new(
                state.clone(),
                lora,
                id,
                created,
                &params,
                count,
            )),
        };
        return Ok(sse_response(SseBody::new(rx, count, formatter)));
    }
    let outcomes = collect(rx, count).await?;
    let mut usage = Usage::new(state.config.prompt_tokens_details);
    for o in &outcomes {
        add_usage(&mut usage, o, params.n);
    }
    let model = model_name(&state, lora.as_ref());
    let kv_transfer_params = match leg {
        Leg::Prefill => {
            let (host, port) = state.side_channel.clone();
            let first = outcomes.first();
            let blocks = first.map(|o| o.held_blocks.clone()).unwrap_or_default();
            let counts = PrefillCounts {
                prompt_tokens: first.map_or(0, |o| o.prompt_tokens),
                cached_tokens: first.map_or(0, |o| o.cached_tokens),
            };
            Some(KvTransferParams::prefilled(
                &state.addr,
                host,
                port,
                id.clone(),
                blocks,
                counts,
            ))
        }
        Leg::Plain | Leg::Decode(_) => None,
    };
    Ok(match endpoint {
        Endpoint::Completions => json_response(
            StatusCode::OK,
            &Completion {
                id: &id,
                object: "text_completion",
                created,
                model,
                choices: outcomes
                    .iter()
                    .map(|o| CompletionChoice {
                        index: o.index,
                        text: match &echo {
                            Some(prompt) => Cow::Owned(format!("{prompt}{}", o.text)),
                            None => Cow::Borrowed(&o.text),
                        },
                        logprobs: None,
                        finish_reason: Some(o.finish.as_str()),
                        stop_reason: o.stop.as_deref(),
                    })
                    .collect(),
                usage: Some(usage),
                kv_transfer_params: Some(kv_transfer_params),
            },
        ),
        Endpoint::Chat => json_response(
            StatusCode::OK,
            &ChatCompletion {
                id: &id,
                object: "chat.completion",
                created,
                model,
                choices: outcomes
                    .iter()
                    .map(|o| ChatChoice {
                        index: o.index,
                        message: ChatMessageOut {
                            role: "assistant",
                            content: &o.text,
                        },
                        logprobs: None,
                        finish_reason: o.finish.as_str(),
                        stop_reason: o.stop.as_deref(),
                    })
                    .collect(),
                usage: Some(usage),
                kv_transfer_params: Some(kv_transfer_params),
            },
        ),
    })
}

/// The prompt a completions request asks to have echoed (`None`: no `echo`); the simulator
/// echoes only a single text prompt (it cannot turn token ids back into text).
fn echoed_prompt(req: &CompletionRequest) -> Result<Option<String>, ApiError> {
    if req.echo != Some(true) {
        return Ok(None);
    }
    match &req.prompt {
        PromptInput::Text(prompt) => Ok(Some(prompt.clone())),
        _ => Err(ApiError::bad_request(
            "echo: the simulator echoes a single text prompt only".to_owned(),
        )
        .with_param("echo")),
    }
}

/// Which leg of disaggregated serving a request is.
#[derive(Debug)]
enum Leg {
    /// An ordinary request.
    Plain,
    /// A prefill leg: keep its KV for a remote decode.
    Prefill,
    /// A decode leg: pull the KV a prefill engine holds first.
    Decode(RemotePrefill),
}

impl Leg {
    /// The leg `transfer` asks for, checked against the engine's role and the request.
    fn of(
        state: &EngineState,
        transfer: Option<&KvTransferParams>,
        params: &GenParams,
        sequences: usize,
    ) -> Result<Self, ApiError> {
        // An SGLang engine does not read `kv_transfer_params`.
        let sglang = state.config.kv_transfer.sglang.mode != DisaggregationMode::Null;
        let Some(transfer) = transfer.filter(|_| !sglang) else {
            return Ok(Self::Plain);
        };
        let invalid =
            |message: String| Err(ApiError::bad_request(message).with_param("kv_transfer_params"));
        let role = state.config.kv_transfer.role;
        let leg = match transfer.remote_prefill() {
            Err(field) => return invalid(format!("kv_transfer_params.{field} is missing")),
            Ok(Some(_)) if transfer.do_remote_decode => {
                return invalid(
                    "do_remote_decode and do_remote_prefill cannot both be true".to_owned(),
                );
            }
            Ok(Some(_)) if !role.consumes() => {
                return invalid(format!(
                    "this engine's role is {}: it does not pull remote KV",
                    role.as_str()
                ));
            }
            Ok(Some(remote)) => Self::Decode(remote),
            Ok(None) if !transfer.do_remote_decode => return Ok(Self::Plain),
            Ok(None) if !role.produces() => {
                return invalid(format!(
                    "this engine's role is {}: it does not keep KV for a remote decode",
                    role.as_str()
                ));
            }
            Ok(None) if params.stream => {
                return invalid("a prefill leg (do_remote_decode) must not stream".to_owned());
            }
            Ok(None) => Self::Prefill,
        };
        if sequences != 1 {
            return invalid("a disaggregated leg takes exactly one prompt and n: 1".to_owned());
        }
        Ok(leg)
    }
}

/// A `text/event-stream` response around `body`.
pub(crate) fn sse_response(body: SseBody) -> Response<ResponseBody> {
    let mut res = Response::new(ResponseBody::Sse(Box::new(body)));
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    res.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

fn write_failure(out: &mut BytesMut, message: String) {
    write_raw(
        out,
        &ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).body_json(),
    );
}

/// `text_completion` chunks.
#[derive(Debug)]
struct CompletionStream {
    state: Arc<EngineState>,
    lora: Option<Lora>,
    id: String,
    created: u64,
    include_usage: bool,
    usage: Usage,
    /// Choices per prompt.
    n: usize,
    /// The prompt to put before each choice's first generated text (`echo`).
    echo: Option<String>,
    /// Per choice: its echo is still to be sent.
    echo_pending: Vec<bool>,
}

impl CompletionStream {
    fn new(
        state: Arc<EngineState>,
        lora: Option<Lora>,
        id: String,
        created: u64,
        params: &GenParams,
        echo: Option<String>,
        choices: usize,
    ) -> Self {
        let usage = Usage::new(state.config.prompt_tokens_details);
        Self {
            state,
            lora,
            id,
            created,
            include_usage: params.include_usage,
            usage,
            n: params.n,
            echo_pending: vec![echo.is_some(); choices],
            echo,
        }
    }

    fn chunk<'a>(
        &'a self,
        choices: Vec<CompletionChoice<'a>>,
        usage: Option<Usage>,
    ) -> Completion<'a> {
        Completion {
            id: &self.id,
            object: "text_completion",
            created: self.created,
            model: model_name(&self.state, self.lora.as_ref()),
            choices,
            usage,
            kv_transfer_params: None,
        }
    }
}

impl StreamFormatter for CompletionStream {
    fn event(&mut self, event: SeqEvent, out: &mut BytesMut) {
        let (index, text, finish, stop) = match &event {
            SeqEvent::Delta { text, .. } if text.is_empty() => return,
            SeqEvent::Delta { index, text } => (*index, text.as_str(), None, None),
            SeqEvent::Finished(o) => {
                add_usage(&mut self.usage, o, self.n);
                (
                    o.index,
                    o.text.as_str(),
                    Some(o.finish.as_str()),
                    o.stop.as_deref(),
                )
            }
            SeqEvent::Failed { message, .. } => return write_failure(out, message.clone()),
        };
        // vLLM sends the echoed prompt with each choice's first token's text.
        let pending = self.echo_pending.get_mut(index as usize);
        let text = match (self.echo.as_deref(), pending) {
            (Some(prompt), Some(pending)) if *pending => {
                *pending = false;
                Cow::Owned(format!("{prompt}{text}"))
            }
            _ => Cow::Borrowed(text),
        };
        let choice = CompletionChoice {
            index,
            text,
            logprobs: None,
            finish_reason: finish,
            stop_reason: stop,
        };
        write_data(out, &self.chunk(vec![choice], None));
    }

    fn finish(&mut self, out: &mut BytesMut) {
        if self.include_usage {
            write_data(out, &self.chunk(Vec::new(), Some(self.usage)));
        }
    }
}

/// `chat.completion.chunk` chunks; each choice's first chunk carries the role.
#[derive(Debug)]
struct ChatStream {
    state: Arc<EngineState>,
    lora: Option<Lora>,
    id: String,
    created: u64,
    include_usage: bool,
    usage: Usage,
    /// Choices per prompt.
    n: usize,
    started: Vec<bool>,
}

impl ChatStream {
    fn new(
        state: Arc<EngineState>,
        lora: Option<Lora>,
        id: String,
        created: u64,
        params: &GenParams,
        choices: usize,
    ) -> Self {
        let usage = Usage::new(state.config.prompt_tokens_details);
        Self {
            state,
            lora,
            id,
            created,
            include_usage: params.include_usage,
            usage,
            n: params.n,
            started: vec![false; choices],
        }
    }

    fn write(&self, out: &mut BytesMut, choices: Vec<ChatChunkChoice<'_>>, usage: Option<Usage>) {
        let chunk = ChatCompletion {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: model_name(&self.state, self.lora.as_ref()),
            choices,
            usage,
            kv_transfer_params: None,
        };
        write_data(out, &chunk);
    }

    fn start(&mut self, index: u32, out: &mut BytesMut) {
        let Some(started) = self.started.get_mut(index as usize) else {
            return;
        };
        if *started {
            return;
        }
        *started = true;
        let delta = ChatDelta {
            role: Some("assistant"),
            content: Some(""),
        };
        self.write(
            out,
            vec![ChatChunkChoice {
                index,
                delta,
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
            }],
            None,
        );
    }
}

impl StreamFormatter for ChatStream {
    fn event(&mut self, event: SeqEvent, out: &mut BytesMut) {
        match &event {
            SeqEvent::Delta { index, text } => {
                self.start(*index, out);
                if !text.is_empty() {
                    let delta = ChatDelta {
                        role: None,
                        content: Some(text),
                    };
                    let choice = ChatChunkChoice {
                        index: *index,
                        delta,
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                    };
                    self.write(out, vec![choice], None);
                }
            }
            SeqEvent::Finished(o) => {
                self.start(o.index, out);
                add_usage(&mut self.usage, o, self.n);
                let content = (!o.text.is_empty()).then_some(o.text.as_str());
                let delta = ChatDelta {
                    role: None,
                    content,
                };
                let choice = ChatChunkChoice {
                    index: o.index,
                    delta,
                    logprobs: None,
                    finish_reason: Some(o.finish.as_str()),
                    stop_reason: Some(o.stop.as_deref()),
                };
                self.write(out, vec![choice], None);
            }
            SeqEvent::Failed { message, .. } => write_failure(out, message.clone()),
        }
    }

    fn finish(&mut self, out: &mut BytesMut) {
        if self.include_usage {
            self.write(out, Vec::new(), Some(self.usage));
        }
    }
}

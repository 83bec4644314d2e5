//! Migration: a stream whose engine breaks off before its last event (the connection reset
//! or closed, the idle timeout, an error event from the engine, the instance leaving
//! discovery) continues on another instance, on the same client stream, up to the model's
//! `migration_limit` times.
//!
//! While a stream is relayed, [`Migration`] keeps its transcript: the `id`, `created` and
//! `model` of its chunks, the text generated so far and how many content events carried it.
//! When the engine breaks off, the request is sent again with that text appended:
//! completions with the prompt extended by it, chat with a final assistant message holding
//! it and vLLM's `continue_final_message: true`, `add_generation_prompt: false`; the token
//! limit shrinks by the events already sent. The continuation's events are rewritten to the
//! first chunk's `id`, `created` and `model`, its opening role-only chat event is dropped, and
//! its usage counts the tokens sent before it, so the client sees one stream.
//!
//! Only streams of one choice whose prompt can be extended are migrated: chat, and
//! completions whose prompt is one string, or one list of token ids when the model has a
//! tokenizer (the generated text is encoded and its ids appended). With `echo` (a string
//! prompt only), the prompt the engine echoes before the first token is not generated text:
//! the transcript leaves it out, and the continuation does not echo again.

use std::borrow::Cow;
use std::sync::{Arc, LazyLock};

use bytes::{BufMut, Bytes, BytesMut};
use kvmesh_preprocess::ModelPreprocessor;
use memchr::memmem;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Map, Value, json};

use crate::clock::now_millis;
use crate::failure::FailureKind;
use crate::headers::ClientFraming;
use crate::pool::ModelPool;
use crate::request::pick::Pick;
use crate::request::record::Record;
use crate::route::Route;
use crate::sse::data_values;

use self::scan::{Scanned, first_choice};
use crate::state::State;

/// The search for an error object's key, built once.
static ERROR_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"error\""));

/// What kind of stream is migrated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// A stream's transcript and what its migrations may still do.
#[derive(Debug)]
pub(crate) struct Migration {
    kind: Kind,
    /// The request as first sent, a JSON object.
    request: Map<String, Value>,
    /// Encodes the generated text of a completions stream whose prompt is token ids.
    tokenizer: Option<Arc<ModelPreprocessor>>,
    /// A completions prompt the engine echoes before the first token (`echo`), until seen.
    echoed: Option<String>,
    /// Migrations left.
    left: u32,
    /// The first chunk's `id`, `created` and `model`.
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    /// Generated text relayed so far.
    text: String,
    /// Content events relayed so far (one token each, as engines stream them).
    tokens: u64,
    /// Content events relayed before the continuation now running.
    base_tokens: u64,
    /// The engine finished the choice (a `finish_reason`) or the stream (`[DONE]`).
    finished: bool,
    /// Migrations done.
    done: u32,
    /// How the client's answer is framed, once it started.
    framing: Option<ClientFraming>,
}

/// What one relayed piece of a stream holds for the client.
#[derive(Debug)]
pub(crate) struct Passed {
    /// The events to forward (rewritten on a continuation).
    pub(crate) forward: Bytes,
    /// The engine sent an error event (not forwarded): the stream broke.
    pub(crate) broken: bool,
}

/// One SSE chunk of an OpenAI stream, as far as the transcript reads it.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default)]
    choices: Vec<Choice<'a>>,
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: u64,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow)]
    delta: Option<Delta<'a>>,
    #[serde(borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(borrow)]
    content: Option<Cow<'a, str>>,
}

impl Migration {
    /// The migration state of a request on `route` with `body`, when it is a stream that
    /// may migrate (`limit` above 0); `tokenizer`, the model's, lets a token-id prompt migrate.
    pub(crate) fn new(
        route: Route,
        body: &[u8],
        stream: bool,
        limit: u32,
        tokenizer: Option<&Arc<ModelPreprocessor>>,
    ) -> Option<Self> {
        if !stream || limit == 0 {
            return None;
        }
        let kind = match route {
            Route::ChatCompletions => Kind::Chat,
            Route::Completions => Kind::Completion,
            _ => return None,
        };
        let Ok(Value::Object(request)) = serde_json::from_slice::<Value>(body) else {
            return None;
        };
        let one_choice = request.get("n").is_none_or(|n| n.as_u64() == Some(1));
        let ids = kind == Kind::Completion && token_prompt(&request).is_some();
        let echo = kind == Kind::Completion && request.get("echo") == Some(&Value::Bool(true));
        let echoed = single_prompt(&request).filter(|_| echo).map(str::to_owned);
        let extendable = match kind {
            Kind::Chat => request.get("messages").is_some_and(Value::is_array),
            Kind::Completion if echo => echoed.is_some(),
            Kind::Completion => single_prompt(&request).is_some() || (ids && tokenizer.is_some()),
        };
        (one_choice && extendable).then(|| Self {
            kind,
            request,
            tokenizer: tokenizer.filter(|_| ids).cloned(),
            echoed,
            left: limit,
            id: None,
            created: None,
            model: None,
            text: String::new(),
            tokens: 0,
            base_tokens: 0,
            finished: false,
            done: 0,
            framing: None,
        })
    }

    /// Whether a continuation is being relayed (its engine's head is not the client's).
    pub(crate) fn continuing(&self) -> bool {
        self.done > 0
    }

    /// How the client's answer is framed, when a continuation writes into it (`None`: the
    /// first attempt, which starts it).
    pub(crate) fn framing(&self) -> Option<ClientFraming> {
        self.framing.filter(|_| self.continuing())
    }

    /// The client's answer started with `framing`.
    pub(crate) fn started(&mut self, framing: ClientFraming) {
        self.framing = Some(framing);
    }

    /// Whether a break now could continue elsewhere: migrations left, the engine had not
    /// finished, the client's answer is an open SSE stream that identified itself.
    pub(crate) fn may_continue(&self) -> bool {
        let tokens_left = ["max_tokens", "max_completion_tokens"].iter().all(|key| {
            self.request
                .get(*key)
                .and_then(Value::as_u64)
                .is_none_or(|limit| limit > self.tokens)
        });
        self.left > 0
            && !self.finished
            && tokens_left
            && self.id.is_some()
            && self.framing == Some(ClientFraming::Open)
    }

    /// Takes in `events` (whole SSE events) on their way to the client: the transcript
    /// grows, a continuation's events are rewritten, an engine error event is held back.
    pub(crate) fn pass(&mut self, events: Bytes) -> Passed {
        if !self.continuing() && ERROR_KEY.find(&events).is_none() {
            for data in data_values(&events) {
                self.observe(data);
            }
            return Passed {
                forward: events,
                broken: false,
            };
        }
        let mut out = BytesMut::with_capacity(events.len() + 64);
        for event in split_events(&events) {
            let Some(data) = data_values(event).next() else {
                out.put_slice(event);
                continue;
            };
            if is_error_event(data) {
                return Passed {
                    forward: out.freeze(),
                    broken: true,
                };
            }
            if !self.continuing() {
                self.observe(data);
                out.put_slice(event);
                continue;
            }
            if let Some(rewritten) = self.rewrite(data) {
                self.observe(&rewritten);
                out.put_slice(b"data: ");
                out.put_slice(&rewritten);
                out.put_slice(b"\n\n");
            }
        }
        Passed {
            forward: out.freeze(),
            broken: false,
        }
    }

    /// Records one event's data in the transcript.
    fn observe(&mut self, data: &[u8]) {
        if data == b"[DONE]" {
            self.finished = true;
            return;
        }
        if self.id.is_none()
            && let Ok(Value::Object(head)) = serde_json::from_slice::<Value>(data)
        {
            self.id = head.get("id").cloned();
            self.created = head.get("created").cloned();
            self.model = head.get("model").cloned();
        }
        if let Scanned::Choice { piece, finished } = first_choice(data, self.kind == Kind::Chat) {
            self.take_piece(piece, finished);
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
            return;
        };
        for choice in chunk.choices.iter().filter(|choice| choice.index == 0) {
            let piece = match self.kind {
                Kind::Completion => choice.text.as_deref(),
                Kind::Chat => choice.delta.as_ref().and_then(|d| d.content.as_deref()),
            };
            self.take_piece(piece, choice.finish_reason.is_some());
        }
    }

    /// Takes choice 0's `piece` of one event into the transcript (`finished`: the event
    /// ended the choice).
    fn take_piece(&mut self, piece: Option<&str>, finished: bool) {
        let piece = match (piece, self.echoed.take()) {
            (Some(piece), Some(prompt)) => match piece.strip_prefix(prompt.as_str()) {
                Some(generated) => Some(generated),
                None => {
                    // Not the echo expected: the transcript cannot tell the text apart.
                    self.left = 0;
                    Some(piece)
                }
            },
            (piece, prompt) => {
                self.echoed = prompt;
                piece
            }
        };
        if let Some(piece) = piece.filter(|p| !p.is_empty()) {
            self.text.push_str(piece);
            self.tokens += 1;
        }
        if finished {
            self.finished = true;
        }
    }

    /// A continuation event as the client should see it (`None`: dropped).
    fn rewrite(&self, data: &[u8]) -> Option<Vec<u8>> {
        let Ok(Value::Object(mut chunk)) = serde_json::from_slice::<Value>(data) else {
            return Some(data.to_vec());
        };
        if self.kind == Kind::Chat && is_role_only(&chunk) {
            return None;
        }
        for (key, value) in [
            ("id", &self.id),
            ("created", &self.created),
            ("model", &self.model),
        ] {
            if let (Some(value), Some(slot)) = (value, chunk.get_mut(key)) {
                *slot = value.clone();
            }
        }
        if let Some(Value::Object(usage)) = chunk.get_mut("usage") {
            let before = self.base_tokens;
            let get = |usage: &Map<String, Value>, key: &str| {
                usage.get(key).and_then(Value::as_u64).unwrap_or(0)
            };
            let prompt = get(usage, "prompt_tokens").saturating_sub(before);
            let completion = get(usage, "completion_tokens") + before;
            usage.insert("prompt_tokens".into(), prompt.into());
            usage.insert("completion_tokens".into(), completion.into());
            usage.insert("total_tokens".into(), (prompt + completion).into());
        }
        serde_json::to_vec(&chunk).ok()
    }

    /// The body of the next continuation, when the stream may migrate now (migrations
    /// left, the engine had not finished, something of the stream identified it); counts
    /// the migration.
    pub(crate) fn next_body(&mut self) -> Option<Bytes> {
        if !self.may_continue() {
            return None;
        }
        let mut request = self.request.clone();
        match self.kind {
            Kind::Chat => extend_chat(&mut request, &self.text),
            Kind::Completion => match &self.tokenizer {
                Some(tokenizer) => extend_token_prompt(&mut request, tokenizer, &self.text)?,
                None => extend_prompt(&mut request, &self.text)?,
            },
        }
        if request.contains_key("echo") {
            // The client has the echo already.
            request.insert("echo".into(), Value::Bool(false));
        }
        for key in ["max_tokens", "max_completion_tokens", "min_tokens"] {
            if let Some(limit) = request.get(key).and_then(Value::as_u64) {
                request.insert(key.into(), limit.saturating_sub(self.tokens).into());
            }
        }
        let body = serde_json::to_vec(&request).ok()?;
        self.left -= 1;
        self.done += 1;
        self.base_tokens = self.tokens;
        Some(Bytes::from(body))
    }
}

/// Counts the migration of `record`'s stream away from `pick`, broken by `kind` (which
/// also counts towards the instance's ejection).
pub(crate) fn migrated(
    state: &State,
    pool: &ModelPool,
    pick: &Pick<'_>,
    kind: FailureKind,
    record: &mut Record,
) {
    pick.instance
        .record_failure(kind, &state.outlier, now_millis());
    pool.metrics().migrations[kind.index()].inc();
    record.migrations += 1;
    tracing::info!(
        instance = %pick.instance.url(),
        failure = kind.label(),
        migration = record.migrations,
        "stream broke off: continuing on another instance"
    );
}

/// The request's prompt when it is one string (or a list of one string).
fn single_prompt(request: &Map<String, Value>) -> Option<&str> {
    match request.get("prompt")? {
        Value::String(prompt) => Some(prompt),
        Value::Array(list) if list.len() == 1 => list[0].as_str(),
        _ => None,
    }
}

/// The request's prompt when it is one list of token ids (or a list of one such list).
fn token_prompt(request: &Map<String, Value>) -> Option<&[Value]> {
    let list = match request.get("prompt")? {
        Value::Array(list) if list.len() == 1 && list[0].is_array() => list[0].as_array()?,
        Value::Array(list) => list,
        _ => return None,
    };
    (!list.is_empty() && list.iter().all(Value::is_u64)).then_some(list.as_slice())
}

/// The completions request with the ids of `text` appended to its token-id prompt.
fn extend_token_prompt(
    request: &mut Map<String, Value>,
    tokenizer: &ModelPreprocessor,
    text: &str,
) -> Option<()> {
    let mut prompt = token_prompt(request)?.to_vec();
    let generated = tokenizer.encode_continuation(text).ok()?;
    prompt.extend(generated.into_iter().map(Value::from));
    request.insert("prompt".into(), Value::Array(prompt));
    Some(())
}

/// The completions request with `text` appended to its prompt.
fn extend_prompt(request: &mut Map<String, Value>, text: &str) -> Option<()> {
    let prompt = format!("{}{text}", single_prompt(request)?);
    request.insert("prompt".into(), Value::String(prompt));
    Some(())
}

/// The chat request continuing `text` as the assistant's final message (appended to one the
/// client already asked to continue).
fn extend_chat(request: &mut Map<String, Value>, text: &str) {
    let continuing = request.get("continue_final_message") == Some(&Value::Bool(true));
    if let Some(Value::Array(messages)) = request.get_mut("messages") {
        let last = messages.last_mut().filter(|_| continuing);
        match last.and_then(|m| m.get_mut("content")) {
            Some(Value::String(content)) => content.push_str(text),
            _ => messages.push(json!({"role": "assistant", "content": text})),
        }
    }
    request.insert("continue_final_message".into(), Value::Bool(true));
    request.insert("add_generation_prompt".into(), Value::Bool(false));
}

/// Whether a chat chunk only opens the assistant's message (a role and no content).
fn is_role_only(chunk: &Map<String, Value>) -> bool {
    let Some(Value::Array(choices)) = chunk.get("choices") else {
        return false;
    };
    !choices.is_empty()
        && chunk.get("usage").is_none_or(Value::is_null)
        && choices.iter().all(|choice| {
            let delta = &choice["delta"];
            delta.get("role").is_some()
                && delta["content"].as_str().is_none_or(str::is_empty)
                && choice["finish_reason"].is_null()
        })
}

/// Whether an event's data is an error object.
fn is_error_event(data: &[u8]) -> bool {
    serde_json::from_slice::<Chunk<'_>>(data).is_ok_and(|chunk| chunk.error.is_some())
}

/// The events of `bytes` (whole events, each with its blank line: `\n\n` or `\r\n\r\n`).
fn split_events(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut from = 0;
        let end = loop {
            let Some(newline) = memchr::memchr(b'\n', &rest[from..]) else {
                break rest.len();
            };
            let after = from + newline + 1;
            let tail = &rest[after..];
            if tail.starts_with(b"\n") {
                break after + 1;
            }
            if tail.starts_with(b"\r\n") {
                break after + 2;
            }
            from = after;
        };
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

mod scan;

#[cfg(test)]
mod tests;

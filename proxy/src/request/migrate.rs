//! Migration: a stream whose engine breaks off before its last event (the connection reset
//! or closed, the idle timeout, an error event from the engine, the instance leaving
//! discovery) continues on another instance, on the same client stream, up to the model's
//! `migration_limit` times.
//!
//! While a stream is relayed, [`Migration`] keeps its transcript: the `id`, `created` and
//! `model` of its chunks, the text generated so far and how many content events carried it.
//! When the engine breaks off, the request is sent again with that text appended:
//! completions with the prompt extended by it, chat continued as the engine's protocol
//! continues a final assistant message ([`crate::engines::protocol::vllm::continue_chat`]); the token
//! limit shrinks by the events already sent. The continuation's events are rewritten to the
//! first chunk's `id`, `created` and `model`, its opening role-only chat event is dropped, and
//! its usage counts the tokens sent before it, so the client sees one stream.
//!
//! A stream of several choices (`n > 1`) keeps a transcript per choice. Each choice the
//! engine had not finished goes on in turn, one continuation (`n: 1`) after another on the
//! same client stream, with its events' `index` rewritten to the choice's; the `[DONE]` and
//! usage chunk of every continuation but the last are dropped, and the last one's usage counts
//! every choice's tokens.
//!
//! Only streams whose prompt can be extended are migrated: chat, and completions whose prompt
//! is one string, or one list of token ids when the model has a tokenizer (the generated text
//! is encoded and its ids appended). With `echo` (a string prompt), the prompt the engine
//! echoes before each choice's first token is not generated text: the transcript leaves it
//! out, and a continuation echoes only for a choice that had not started.

use std::borrow::Cow;
use std::sync::{Arc, LazyLock};

use bytes::{BufMut, Bytes, BytesMut};
use kvmesh_preprocess::ModelPreprocessor;
use kvmesh_wire::choice_scan::{Scanned, only_choice};
use kvmesh_wire::sse::{data_values, split_events};
use memchr::memmem;
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Map, Value};

use crate::engines::clock::now_millis;
use crate::engines::pool::ModelPool;
use crate::engines::protocol::vllm;
use crate::metrics::failure::FailureKind;
use crate::openai::headers::ClientFraming;
use crate::openai::route::Route;
use crate::request::pick::Pick;
use crate::request::record::Record;
use crate::state::shared::State;

/// The search for an error object's key, built once.
static ERROR_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"error\""));

/// The most choices (`n`) of a stream that may migrate.
const MAX_CHOICES: u64 = 128;

/// What kind of stream is migrated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// One choice's part of a transcript.
#[derive(Debug, Default, Clone)]
struct ChoiceText {
    /// Generated text relayed so far.
    text: String,
    /// Content events relayed so far (one token each, as engines stream them).
    tokens: u64,
    /// The engine finished it (a `finish_reason`).
    finished: bool,
    /// The engine is still to echo the prompt before its first token (`echo`).
    echo_pending: bool,
}

/// A stream's transcript and what its migrations may still do.
#[derive(Debug)]
pub(crate) struct Migration {
    kind: Kind,
    /// The request as first sent, a JSON object.
    request: Map<String, Value>,
    /// Encodes the generated text of a completions stream whose prompt is token ids.
    tokenizer: Option<Arc<ModelPreprocessor>>,
    /// A completions prompt the engine echoes before each choice's first token (`echo`).
    echoed: Option<String>,
    /// Migrations left.
    left: u32,
    /// The first chunk's `id`, `created` and `model`.
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    /// Each choice's transcript, by index (`n` of them).
    choices: Vec<ChoiceText>,
    /// The choice the continuation now running carries.
    current: usize,
    /// Its content events relayed before that continuation.
    base_tokens: u64,
    /// The client's stream ended (`[DONE]` forwarded).
    ended: bool,
    /// Continuations started (migrations and the choices that went on after them).
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
    /// Events among `forward` that carried generated text (one token each), as the transcript
    /// counted them.
    pub(crate) text_events: u64,
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
        let n = match request.get("n") {
            None | Some(Value::Null) => 1,
            Some(n) => n.as_u64().filter(|n| (1..=MAX_CHOICES).contains(n))? as usize,
        };
        let ids = kind == Kind::Completion && token_prompt(&request).is_some();
        let echo = kind == Kind::Completion && request.get("echo") == Some(&Value::Bool(true));
        let echoed = single_prompt(&request).filter(|_| echo).map(str::to_owned);
        let extendable = match kind {
            Kind::Chat => request.get("messages").is_some_and(Value::is_array),
            Kind::Completion if echo => echoed.is_some(),
            Kind::Completion => single_prompt(&request).is_some() || (ids && tokenizer.is_some()),
        };
        extendable.then(|| Self {
            kind,
            request,
            tokenizer: tokenizer.filter(|_| ids).cloned(),
            echoed,
            left: limit,
            id: None,
            created: None,
            model: None,
            choices: vec![
                ChoiceText {
                    echo_pending: echo,
                    ..ChoiceText::default()
                };
                n
            ],
            current: 0,
            base_tokens: 0,
            ended: false,
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

    /// Whether a break now could continue elsewhere: migrations left, a choice the engine
    /// had not finished, the client's answer is an open SSE stream that identified itself.
    pub(crate) fn may_continue(&self) -> bool {
        self.left > 0
            && self.next_choice().is_some()
            && self.id.is_some()
            && self.framing == Some(ClientFraming::Open)
    }

    /// The choice the continuation now running carries, when the stream has several.
    pub(crate) fn choice_carried(&self) -> Option<usize> {
        (self.continuing() && self.choices.len() > 1).then_some(self.current)
    }

    /// Whether the continuation now running finished its choice and another one is to go on
    /// (a stream of several choices): its engine's end is not the client's.
    pub(crate) fn another_choice(&self) -> bool {
        self.continuing() && self.choices[self.current].finished && self.next_choice().is_some()
    }

    /// The choice a continuation would carry: the current one while unfinished, else the
    /// first unfinished one (`None`: the stream ended, or every choice did).
    fn next_choice(&self) -> Option<usize> {
        if self.ended {
            return None;
        }
        let open = |index: &usize| {
            let choice = &self.choices[*index];
            !choice.finished && self.tokens_left(choice.tokens)
        };
        Some(self.current)
            .filter(open)
            .or_else(|| (0..self.choices.len()).find(open))
    }

    /// Whether a choice that generated `tokens` may generate more.
    fn tokens_left(&self, tokens: u64) -> bool {
        ["max_tokens", "max_completion_tokens"].iter().all(|key| {
            self.request
                .get(*key)
                .and_then(Value::as_u64)
                .is_none_or(|limit| limit > tokens)
        })
    }

    /// Takes in `events` (whole SSE events) on their way to the client: the transcript
    /// grows, a continuation's events are rewritten, an engine error event is held back.
    pub(crate) fn pass(&mut self, events: Bytes) -> Passed {
        let before = self.text_events();
        if !self.continuing() && ERROR_KEY.find(&events).is_none() {
            for data in data_values(&events) {
                self.observe(data);
            }
            return Passed {
                forward: events,
                broken: false,
                text_events: self.text_events() - before,
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
                    text_events: self.text_events() - before,
                };
            }
            if !self.continuing() {
                self.observe(data);
                out.put_slice(event);
                continue;
            }
            if data == b"[DONE]" && self.another_choice() {
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
            text_events: self.text_events() - before,
        }
    }

    /// Content events relayed so far, every choice's.
    fn text_events(&self) -> u64 {
        self.choices.iter().map(|choice| choice.tokens).sum()
    }

    /// Records one event's data in the transcript.
    fn observe(&mut self, data: &[u8]) {
        if data == b"[DONE]" {
            self.ended = true;
            return;
        }
        if self.id.is_none()
            && let Ok(Value::Object(head)) = serde_json::from_slice::<Value>(data)
        {
            self.id = head.get("id").cloned();
            self.created = head.get("created").cloned();
            self.model = head.get("model").cloned();
        }
        let chat = self.kind == Kind::Chat;
        if let Scanned::Choice {
            index,
            piece,
            finished,
        } = only_choice(data, chat)
        {
            self.take_piece(index, piece, finished);
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk<'_>>(data) else {
            return;
        };
        for choice in &chunk.choices {
            let piece = match self.kind {
                Kind::Completion => choice.text.as_deref(),
                Kind::Chat => choice.delta.as_ref().and_then(|d| d.content.as_deref()),
            };
            let index = usize::try_from(choice.index).unwrap_or(usize::MAX);
            self.take_piece(index, piece, choice.finish_reason.is_some());
        }
    }

    /// Takes choice `index`'s `piece` of one event into the transcript (`finished`: the event
    /// ended the choice).
    fn take_piece(&mut self, index: usize, piece: Option<&str>, finished: bool) {
        let Some(choice) = self.choices.get_mut(index) else {
            // A choice the request did not ask for: nothing can continue it.
            self.left = 0;
            return;
        };
        let echoed = self.echoed.as_deref().filter(|_| choice.echo_pending);
        let piece = match (piece, echoed) {
            (Some(piece), Some(prompt)) => {
                choice.echo_pending = false;
                match piece.strip_prefix(prompt) {
                    Some(generated) => Some(generated),
                    None => {
                        // Not the echo expected: the transcript cannot tell the text apart.
                        self.left = 0;
                        Some(piece)
                    }
                }
            }
            (piece, _) => piece,
        };
        if let Some(piece) = piece.filter(|p| !p.is_empty()) {
            choice.text.push_str(piece);
            choice.tokens += 1;
        }
        if finished {
            choice.finished = true;
        }
    }

    /// A continuation event as the client should see it (`None`: dropped): its stream's
    /// `id`, `created` and `model`, its choice's index, and usage counting every choice.
    fn rewrite(&self, data: &[u8]) -> Option<Vec<u8>> {
        let Ok(Value::Object(mut chunk)) = serde_json::from_slice::<Value>(data) else {
            return Some(data.to_vec());
        };
        if self.kind == Kind::Chat && is_role_only(&chunk) {
            return None;
        }
        let usage = chunk.get("usage").is_some_and(Value::is_object);
        if usage && self.another_choice() {
            // The last choice's usage counts them all.
            return None;
        }
        if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
            for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
                choice.insert("index".into(), self.current.into());
            }
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
            let others = self.text_events() - self.choices[self.current].tokens;
            let get = |usage: &Map<String, Value>, key: &str| {
                usage.get(key).and_then(Value::as_u64).unwrap_or(0)
            };
            let prompt = get(usage, "prompt_tokens").saturating_sub(before);
            let completion = get(usage, "completion_tokens") + before + others;
            usage.insert("prompt_tokens".into(), prompt.into());
            usage.insert("completion_tokens".into(), completion.into());
            usage.insert("total_tokens".into(), (prompt + completion).into());
        }
        serde_json::to_vec(&chunk).ok()
    }

    /// The body of the next continuation, when the stream may migrate now (migrations
    /// left, a choice the engine had not finished, something of the stream identified it);
    /// counts the migration.
    pub(crate) fn next_body(&mut self) -> Option<Bytes> {
        if !self.may_continue() {
            return None;
        }
        let body = self.continuation()?;
        self.left -= 1;
        Some(body)
    }

    /// The body of the continuation carrying the next unfinished choice, once the one now
    /// running finished its own ([`Migration::another_choice`]); not a migration.
    pub(crate) fn next_choice_body(&mut self) -> Option<Bytes> {
        if !self.another_choice() {
            return None;
        }
        self.continuation()
    }

    /// The request again for the next unfinished choice, with its text so far appended and
    /// its token limits reduced by it (one choice: `n` dropped).
    fn continuation(&mut self) -> Option<Bytes> {
        let index = self.next_choice()?;
        let choice = &self.choices[index];
        let mut request = self.request.clone();
        match self.kind {
            Kind::Chat => vllm::continue_chat(&mut request, &choice.text),
            Kind::Completion => match &self.tokenizer {
                Some(tokenizer) => extend_token_prompt(&mut request, tokenizer, &choice.text)?,
                None => extend_prompt(&mut request, &choice.text)?,
            },
        }
        if request.contains_key("echo") {
            // The client has the echo already, unless the choice had not started.
            request.insert("echo".into(), Value::Bool(choice.echo_pending));
        }
        request.remove("n");
        request.remove("best_of");
        for key in ["max_tokens", "max_completion_tokens", "min_tokens"] {
            if let Some(limit) = request.get(key).and_then(Value::as_u64) {
                request.insert(key.into(), limit.saturating_sub(choice.tokens).into());
            }
        }
        let body = serde_json::to_vec(&request).ok()?;
        self.done += 1;
        self.current = index;
        self.base_tokens = choice.tokens;
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

#[cfg(test)]
mod tests;

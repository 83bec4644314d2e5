//! Workloads with their own arrival times: Mooncake trace replay and synthetic chat. Every body
//! is built before the run, so sending costs no serialisation.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::ValueEnum;
use serde_json::{Value, json};

use crate::chat::ChatTurn;
use crate::target::Target;
use crate::trace::TraceRecord;
use crate::workload::{Endpoint, WorkItem, Workload, WorkloadError};

/// How a trace prompt is written into the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PromptFormat {
    /// `"prompt": [id, ...]`, token ids.
    Ids,
    /// `"prompt": "id id ..."`, one decimal word per token id.
    Text,
}

impl PromptFormat {
    /// The lower-case name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ids => "ids",
            Self::Text => "text",
        }
    }
}

/// What every trace request shares.
#[derive(Debug, Clone)]
pub struct TraceRequestSpec {
    /// `model` field.
    pub model: String,
    /// Ask for SSE responses.
    pub stream: bool,
    /// How prompts are written.
    pub format: PromptFormat,
    /// Tokens per trace hash id.
    pub trace_block_size: usize,
    /// Arrival times are divided by this.
    pub time_scale: f64,
}

/// Prebuilt requests, sent once each at their arrival offsets.
#[derive(Debug, Clone)]
pub struct ScheduledWorkload {
    items: Vec<WorkItem>,
    offsets: Arc<[Duration]>,
}

impl ScheduledWorkload {
    /// One `/v1/completions` request per trace record: the expanded prompt, `max_tokens` = the
    /// record's output length (at least 1) and `ignore_eos`, so an engine generates exactly that.
    pub fn from_trace(
        records: &[TraceRecord],
        spec: &TraceRequestSpec,
        target: &Target,
        http2: bool,
    ) -> Result<Self, WorkloadError> {
        let uri = target.endpoint_uri(Endpoint::Completions.path(), http2)?;
        let mut tokens = Vec::new();
        let mut items = Vec::with_capacity(records.len());
        for record in records {
            record.expand_into(spec.trace_block_size, &mut tokens);
            let prompt = match spec.format {
                PromptFormat::Ids => json!(tokens),
                PromptFormat::Text => Value::String(number_words(&tokens)),
            };
            let mut body = json!({
                "model": spec.model,
                "prompt": prompt,
                "max_tokens": record.output_length.max(1),
                "ignore_eos": true,
                "stream": spec.stream,
            });
            include_usage(&mut body, spec.stream);
            items.push(WorkItem {
                uri: uri.clone(),
                body: Bytes::from(serde_json::to_vec(&body)?),
                stream: spec.stream,
            });
        }
        Ok(Self {
            items,
            offsets: crate::trace::arrival_offsets(records, spec.time_scale).into(),
        })
    }

    /// One `/v1/chat/completions` request per chat turn, with `max_tokens` and `ignore_eos`.
    pub fn from_chat(
        turns: &[ChatTurn],
        model: &str,
        max_tokens: u32,
        stream: bool,
        target: &Target,
        http2: bool,
    ) -> Result<Self, WorkloadError> {
        let uri = target.endpoint_uri(Endpoint::Chat.path(), http2)?;
        let mut items = Vec::with_capacity(turns.len());
        for turn in turns {
            let messages: Vec<Value> = turn
                .messages
                .iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect();
            let mut body = json!({
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "ignore_eos": true,
                "stream": stream,
            });
            include_usage(&mut body, stream);
            items.push(WorkItem {
                uri: uri.clone(),
                body: Bytes::from(serde_json::to_vec(&body)?),
                stream,
            });
        }
        Ok(Self {
            items,
            offsets: turns.iter().map(|t| t.offset).collect(),
        })
    }

    /// Arrival offsets from the start of the run, one per request.
    pub fn offsets(&self) -> Arc<[Duration]> {
        self.offsets.clone()
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether there is no request.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The request bodies, in arrival order.
    pub fn bodies(&self) -> impl Iterator<Item = &Bytes> {
        self.items.iter().map(|item| &item.body)
    }
}

impl Workload for ScheduledWorkload {
    fn item(&self, index: u64) -> Option<WorkItem> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.items.get(i))
            .cloned()
    }
}

/// Streams end with a usage chunk, so output tokens are counted as the engine reports them.
fn include_usage(body: &mut Value, stream: bool) {
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
}

/// `tokens` as space-separated decimal words.
fn number_words(tokens: &[u32]) -> String {
    let mut text = String::with_capacity(tokens.len() * 7);
    for (i, token) in tokens.iter().enumerate() {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(&token.to_string());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::{ChatSpec, chat_schedule};

    fn records() -> Vec<TraceRecord> {
        vec![
            TraceRecord {
                timestamp: 100,
                input_length: 5,
                output_length: 3,
                hash_ids: vec![7, 8],
            },
            TraceRecord {
                timestamp: 1100,
                input_length: 2,
                output_length: 0,
                hash_ids: vec![7],
            },
        ]
    }

    fn spec(format: PromptFormat) -> TraceRequestSpec {
        TraceRequestSpec {
            model: "m".into(),
            stream: true,
            format,
            trace_block_size: 4,
            time_scale: 10.0,
        }
    }

    async fn target() -> Target {
        Target::resolve("http://127.0.0.1:1").await.expect("target")
    }

    fn body(w: &ScheduledWorkload, i: u64) -> Value {
        serde_json::from_slice(&w.item(i).expect("item").body).expect("json")
    }

    #[tokio::test]
    async fn trace_requests_carry_token_ids_and_output_lengths() {
        let w = ScheduledWorkload::from_trace(
            &records(),
            &spec(PromptFormat::Ids),
            &target().await,
            false,
        )
        .expect("workload");
        assert_eq!(w.len(), 2);
        assert!(w.item(2).is_none());
        let first = body(&w, 0);
        assert_eq!(first["prompt"], json!([7, 7, 7, 7, 8]));
        assert_eq!(first["max_tokens"], 3);
        assert_eq!(first["ignore_eos"], true);
        assert_eq!(first["stream_options"]["include_usage"], true);
        assert_eq!(body(&w, 1)["max_tokens"], 1);
        assert_eq!(w.item(0).expect("item").uri.path(), "/v1/completions");
        assert_eq!(
            w.offsets().to_vec(),
            [Duration::ZERO, Duration::from_millis(100)]
        );
    }

    #[tokio::test]
    async fn text_prompts_have_one_word_per_token() {
        let w = ScheduledWorkload::from_trace(
            &records(),
            &spec(PromptFormat::Text),
            &target().await,
            false,
        )
        .expect("workload");
        assert_eq!(body(&w, 0)["prompt"], "7 7 7 7 8");
    }

    #[tokio::test]
    async fn chat_requests_carry_the_conversation() {
        let turns = chat_schedule(&ChatSpec {
            sessions: 2,
            active_sessions: 2,
            turns: 2,
            system_prompts: 1,
            system_words: 10,
            user_words: 3,
            answer_words: 2,
            rate: 50.0,
            seed: 1,
        });
        let w = ScheduledWorkload::from_chat(&turns, "m", 5, false, &target().await, false)
            .expect("workload");
        assert_eq!(w.len(), 4);
        assert_eq!(w.bodies().count(), 4);
        let last = body(&w, 3);
        assert_eq!(last["messages"].as_array().map(Vec::len), Some(4));
        assert_eq!(last["messages"][0]["role"], "system");
        assert_eq!(last["max_tokens"], 5);
        assert!(last.get("stream_options").is_none());
        assert_eq!(w.item(0).expect("item").uri.path(), "/v1/chat/completions");
        let offsets = w.offsets();
        assert_eq!(offsets[3], turns[3].offset);
    }
}

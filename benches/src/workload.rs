//! What to send: a source of request bodies indexed by request number.
//!
//! [`Workload`] hands out one [`WorkItem`] per request. The synthetic workload returns the same
//! prebuilt body every time (a reference-counted clone, no per-request work). Trace replay and
//! synthetic chat ([`crate::scheduled::ScheduledWorkload`]) prebuild one body per request,
//! return `None` past the last, and pair with their own arrival offsets.

use bytes::Bytes;
use clap::ValueEnum;
use http::Uri;
use serde_json::json;

use crate::prompt::synthetic_prompt;
use crate::target::{Target, TargetError};

/// The OpenAI endpoint to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Endpoint {
    /// `POST /v1/chat/completions` with one user message.
    Chat,
    /// `POST /v1/completions` with a string prompt.
    Completions,
}

impl Endpoint {
    /// The request path of this endpoint.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }

    /// The lower-case name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Completions => "completions",
        }
    }
}

/// The kind of workload a run sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    /// One deterministic prompt, over and over.
    Fixed,
    /// A Mooncake trace replayed at its arrival times.
    Trace,
    /// Synthetic multi-turn chat sessions with shared system prompts.
    Chat,
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct WorkItem {
    /// Request URI (origin-form for HTTP/1.1, absolute for HTTP/2).
    pub uri: Uri,
    /// JSON body.
    pub body: Bytes,
    /// Whether the body asks for a streamed (SSE) response.
    pub stream: bool,
}

/// A source of requests; `item(i)` is the request numbered `i` (from 0), `None` when exhausted.
pub trait Workload: Send + Sync {
    /// The request numbered `index`, or `None` past the end of a finite workload.
    fn item(&self, index: u64) -> Option<WorkItem>;
}

/// Failure to build a workload.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The endpoint URI could not be built from the target.
    #[error(transparent)]
    Uri(#[from] TargetError),
    /// The request body could not be serialised.
    #[error("cannot serialise the request body: {0}")]
    Body(#[from] serde_json::Error),
}

/// Parameters of the synthetic workload.
#[derive(Debug, Clone)]
pub struct SyntheticSpec {
    /// Endpoint to call.
    pub endpoint: Endpoint,
    /// `model` field of the body.
    pub model: String,
    /// Prompt length in words (about one token each).
    pub prompt_words: usize,
    /// `max_tokens` field of the body.
    pub max_tokens: u32,
    /// `stream` field of the body.
    pub stream: bool,
    /// Seed of the first prompt's words.
    pub seed: u64,
    /// Distinct prompts (seeds `seed`, `seed + 1`, ...), sent in turn; at least one.
    pub distinct: usize,
}

/// The same deterministic requests, over and over: one, or a few distinct ones in turn.
#[derive(Debug, Clone)]
pub struct SyntheticWorkload {
    items: Vec<WorkItem>,
}

impl SyntheticWorkload {
    /// Builds the requests once for `target`.
    pub fn new(spec: &SyntheticSpec, target: &Target, http2: bool) -> Result<Self, WorkloadError> {
        let uri = target.endpoint_uri(spec.endpoint.path(), http2)?;
        let items = (0..spec.distinct.max(1) as u64)
            .map(|i| {
                let prompt = synthetic_prompt(spec.prompt_words, spec.seed.wrapping_add(i));
                let body = match spec.endpoint {
                    Endpoint::Chat => json!({
                        "model": spec.model,
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": spec.max_tokens,
                        "stream": spec.stream,
                    }),
                    Endpoint::Completions => json!({
                        "model": spec.model,
                        "prompt": prompt,
                        "max_tokens": spec.max_tokens,
                        "stream": spec.stream,
                    }),
                };
                Ok(WorkItem {
                    uri: uri.clone(),
                    body: Bytes::from(serde_json::to_vec(&body)?),
                    stream: spec.stream,
                })
            })
            .collect::<Result<_, WorkloadError>>()?;
        Ok(Self { items })
    }
}

impl Workload for SyntheticWorkload {
    fn item(&self, index: u64) -> Option<WorkItem> {
        let at = (index % self.items.len() as u64) as usize;
        Some(self.items[at].clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(endpoint: Endpoint) -> SyntheticSpec {
        SyntheticSpec {
            endpoint,
            model: "m".into(),
            prompt_words: 8,
            max_tokens: 16,
            stream: true,
            seed: 1,
            distinct: 1,
        }
    }

    #[tokio::test]
    async fn chat_body_has_one_user_message() {
        let target = Target::resolve("http://127.0.0.1:1").await.expect("target");
        let w = SyntheticWorkload::new(&spec(Endpoint::Chat), &target, false).expect("workload");
        let item = w.item(0).expect("infinite workload");
        assert_eq!(item.uri.path(), "/v1/chat/completions");
        let v: serde_json::Value = serde_json::from_slice(&item.body).expect("json");
        assert_eq!(v["model"], "m");
        assert_eq!(v["max_tokens"], 16);
        assert_eq!(v["stream"], true);
        assert_eq!(v["messages"][0]["role"], "user");
        let words = v["messages"][0]["content"].as_str().expect("content");
        assert_eq!(words.split_whitespace().count(), 8);
    }

    #[tokio::test]
    async fn completions_body_is_the_same_every_time() {
        let target = Target::resolve("http://127.0.0.1:1").await.expect("target");
        let w =
            SyntheticWorkload::new(&spec(Endpoint::Completions), &target, false).expect("workload");
        let a = w.item(0).expect("item");
        let b = w.item(12345).expect("item");
        assert_eq!(a.body, b.body);
        assert_eq!(a.uri.path(), "/v1/completions");
        let v: serde_json::Value = serde_json::from_slice(&a.body).expect("json");
        assert!(v["prompt"].is_string());
    }

    #[tokio::test]
    async fn distinct_prompts_come_in_turn() {
        let target = Target::resolve("http://127.0.0.1:1").await.expect("target");
        let spec = SyntheticSpec {
            distinct: 3,
            ..spec(Endpoint::Completions)
        };
        let w = SyntheticWorkload::new(&spec, &target, false).expect("workload");
        let bodies: Vec<Bytes> = (0..6).map(|i| w.item(i).expect("item").body).collect();
        assert_ne!(bodies[0], bodies[1]);
        assert_ne!(bodies[1], bodies[2]);
        assert_ne!(bodies[0], bodies[2]);
        assert_eq!(bodies[..3], bodies[3..]);
    }
}

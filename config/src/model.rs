//! Models and the backends (engine instances) that serve them.

use std::path::PathBuf;

use serde::Deserialize;

use crate::{BackendUrl, ConcurrencyConfig, DisaggregationConfig, KvRoutingConfig};

/// A model clients can name in the `model` field, and where it is served.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The model's name (listed by `GET /v1/models`).
    pub name: String,
    /// Other names accepted for this model; unique across all models.
    pub aliases: Vec<String>,
    /// How a request picks one of the healthy backends.
    pub policy: PolicyKind,
    /// The engine instances serving this model (at least one).
    pub backends: Vec<BackendConfig>,
    /// Directory holding the model's Hugging Face `tokenizer.json` and
    /// `tokenizer_config.json` (with its chat template), relative to the working
    /// directory. `policy: kv` needs it to route chat and text-prompt requests by
    /// their tokens; without it those fall back to least-loaded routing.
    pub tokenizer: Option<PathBuf>,
    /// Under `policy: kv`, forward a completions request whose `prompt` is one string
    /// with that string replaced by its token ids (`"prompt": [...]`), so the engine
    /// does not tokenize it again. The only body rewrite besides aliases; needs
    /// `tokenizer`.
    pub forward_token_ids: bool,
    /// Settings of `policy: kv`.
    pub kv: KvRoutingConfig,
    /// Requests forwarded to this model at once, and the queue in front.
    pub concurrency: ConcurrencyConfig,
    /// How many times one stream may move to another instance when its engine breaks off
    /// mid-way (`null`: [`DEFAULT_MIGRATION_LIMIT`]; 0: never, the stream ends with an
    /// error event).
    pub migration_limit: Option<u32>,
    /// Prefill on one instance and decode on another (vLLM's NixlConnector protocol);
    /// `null` (the default): every request is served whole by one instance.
    pub disaggregation: Option<DisaggregationConfig>,
    /// Groups of the model's instances (a backend's `pool`, a discovered instance's `pool`
    /// label), each request sent to one chosen by its prompt's length and TTFT target
    /// (Dynamo's global router); empty (the default): one pool of every instance.
    pub pools: Vec<PoolConfig>,
}

/// One pool of a model's instances.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Its name: backends name it in `pool`, discovered instances in their `pool` label.
    pub name: String,
    /// The longest prompt, in tokens, it takes (`null`: any). A request goes to the first
    /// pool, in order, whose bound its prompt fits.
    #[serde(default)]
    pub max_input_tokens: Option<u64>,
    /// A time to first token, ms, the pool should meet: when its best instance predicts
    /// more and a later pool (that takes the prompt) predicts less, the request goes there.
    #[serde(default)]
    pub ttft_target_ms: Option<f64>,
    /// A time between tokens, ms, the pool should meet (Dynamo's decode pools): when its best
    /// instance predicts a longer decode iteration with the request and a later pool (that
    /// takes the prompt) predicts one within it, the request goes there.
    #[serde(default)]
    pub itl_target_ms: Option<f64>,
}

/// Migrations per stream when `migration_limit` is not set.
pub const DEFAULT_MIGRATION_LIMIT: u32 = 1;

impl ModelConfig {
    /// `migration_limit`, or its default.
    pub fn effective_migration_limit(&self) -> u32 {
        self.migration_limit.unwrap_or(DEFAULT_MIGRATION_LIMIT)
    }
}

/// Load-balancing policy among a model's healthy, non-ejected backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each backend in turn.
    #[default]
    RoundRobin,
    /// A uniformly random backend.
    Random,
    /// The backend with the fewest requests in flight (random tie-break).
    LeastRequest,
    /// The less loaded (in flight) of two random backends.
    PowerOfTwo,
    /// KV-cache aware: the backend with the least prefill work left for this request
    /// (cached prefix overlap) and the least decode load (see `kv`).
    Kv,
}

impl PolicyKind {
    /// The name used in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
            Self::LeastRequest => "least_request",
            Self::PowerOfTwo => "power_of_two",
            Self::Kv => "kv",
        }
    }
}

/// One engine instance.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Base URL, `http://host:port`; requests go to the same path as the client's.
    pub url: BackendUrl,
    /// Wire protocol to the backend.
    #[serde(default)]
    pub protocol: Protocol,
    /// LoRA adapters the engine serves besides the model (vLLM's `--lora-modules` names): a
    /// request whose `model` names one goes to the backends that list it.
    #[serde(default)]
    pub adapters: Vec<String>,
    /// Its side of disaggregated serving (the model's `disaggregation`).
    #[serde(default)]
    pub role: Role,
    /// The model's pool it belongs to (`null`: none; it then serves only when the pool a
    /// request is sent to has no instance).
    #[serde(default)]
    pub pool: Option<String>,
    /// The bootstrap port of an SGLang prefill engine (its `--disaggregation-bootstrap-port`)
    /// for `disaggregation.protocol: sglang`; `null`: SGLang's default, 8998.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// Which legs of a disaggregated request an instance takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Both (and whole requests).
    #[default]
    Both,
    /// Prefill legs only.
    Prefill,
    /// Decode legs (and whole requests).
    Decode,
}

impl Role {
    /// Whether it takes prefill legs.
    pub fn prefills(self) -> bool {
        matches!(self, Self::Both | Self::Prefill)
    }

    /// Whether it takes decode legs and whole requests.
    pub fn decodes(self) -> bool {
        matches!(self, Self::Both | Self::Decode)
    }
}

/// Wire protocol spoken to a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// HTTP/1.1 with keep-alive.
    #[default]
    Http1,
    /// HTTP/2 over plaintext with prior knowledge.
    H2c,
}

//! kvmesh-engine-sim: a simulated vLLM engine, so the proxy, the agent and the benchmarks never
//! need a GPU.
//!
//! It speaks vLLM's OpenAI HTTP API over HTTP/1.1 and h2c (prior knowledge) on one port, exposes
//! vLLM's Prometheus metrics, keeps a prefix cache that behaves like vLLM's (ref-counted active
//! blocks, LRU inactive blocks, tail-first release, prefix-chained block hashes) and paces
//! continuous batching with Dynamo's mocker timing model.
//!
//! # Endpoints
//! - `POST /v1/completions` (`prompt`: string, list of strings, token ids, or list of token-id
//!   lists; one choice per prompt), `POST /v1/chat/completions` (ChatML template), both with
//!   `max_tokens` (default 16; `max_completion_tokens` for chat), `stop`, `stream`,
//!   `stream_options.include_usage`; `ignore_eos` is accepted (the simulator never emits EOS:
//!   it generates exactly `max_tokens` unless a stop string matches). `n` must be 1.
//! - `POST /v1/embeddings`: deterministic unit vectors seeded by the input tokens.
//! - `GET /v1/models`, `GET /health`, `GET /metrics`.
//! - For third-party routers: `GET /healthz`, `/readiness`, `/health_generate`,
//!   `/get_server_info`, `/server_info`, `/get_model_info`, `/model_info`, and SGLang's
//!   `POST /generate`.
//! - Admin: `POST /reset_prefix_cache`.
//!
//! Every response carries `x-engine-id: <ip:port>`.
//!
//! # Test-only hooks
//! These request headers exist for tests of clients and proxies; nothing else should send them:
//! - `x-sim-delay-ms: N` delays the response headers by N milliseconds;
//! - `x-sim-status: CODE` answers HTTP status CODE with an OpenAI-shaped error body
//!   (`{"error":{"message","type","param","code"}}`) instead of handling the request.
//!
//! # Library use
//! ```no_run
//! # async fn demo() -> Result<(), kvmesh_engine_sim::SimError> {
//! use kvmesh_engine_sim::{SimConfig, spawn};
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let engine = spawn(SimConfig { no_delay: true, ..SimConfig::default() }, listener).await?;
//! println!("engine at {}", engine.local_addr());
//! engine.stop().await;
//! # Ok(()) }
//! ```

mod chat_template;
pub mod cli;
mod config;
mod embedding;
mod engine;
mod error;
pub mod hashing;
mod histogram;
mod http;
mod kv_cache;
mod kv_events;
mod metrics;
mod output_text;
mod protocol;
mod scheduler;
mod textgen;
mod timing;
mod tokenizer;

pub use config::{PreemptionMode, SimConfig};
pub use engine::{EngineHandle, spawn, spawn_engines};
pub use error::SimError;
pub use kv_events::{KvEvent, KvEventBatch};

//! kvmesh-agent: the worker-agent sidecar that runs beside an unmodified engine (vLLM,
//! SGLang, TensorRT-LLM) and connects it to kvmesh's control plane (docs/agent.md,
//! docs/control-plane.md).
//!
//! - **Events**: subscribes to the engine's ZMQ KV event stream (3 frames: topic, 8-byte
//!   big-endian sequence number, msgpack batch), decodes them with `kvmesh-engine-events`
//!   (both encodings, both hash forms; events of other KV groups and media ignored, malformed
//!   ones counted and skipped). Engine sequence gaps, and a start after the engine, are
//!   repaired from the engine's replay socket. Without an endpoint, vLLM's
//!   `GET /kv_event_sources` says where each rank publishes. TensorRT-LLM's events are polled
//!   from trtllm-serve's `POST /kv_cache_events` instead (JSON; no replay).
//! - **Translation**: re-hashes every stored block from its tokens into kvmesh's hash space
//!   (`kvmesh_kv::BlockHasher`, LoRA and multimodal rules included), keeps the engine id →
//!   kvmesh hash table with reference counts for duplicate stores.
//! - **Publishing**: numbered [`kvmesh_control::EventBatch`]es on `{ns}.kv.{model}` (gap-free
//!   `seq` from 1), the last 4096 kept for replay; `{ns}.snapshot.{id}` answers replay and
//!   full-snapshot requests.
//! - **Registration**: the [`kvmesh_control::InstanceRecord`] under a lease kept alive (and
//!   re-created if lost); engine `/health` drives `ready` / `not_ready`; shutdown advertises
//!   `draining`, waits, then revokes the lease.
//! - **Load**: the engine's `/metrics` → [`kvmesh_control::LoadReport`] on `{ns}.load.{model}`.
//! - **Own endpoints**: `/health` and `/metrics` (see [`AgentMetrics`]).
//!
//! Embedding (the demo): build an [`AgentConfig`], pass in-process `Registry` / `EventBus`
//! implementations to [`start`], keep the [`AgentHandle`], call [`AgentHandle::shutdown`].

mod adapters;
mod agent;
mod cache_config;
pub mod cli;
mod config;
mod core;
mod endpoint;
pub mod engine;
mod engine_facts;
mod error;
mod event_sources;
#[cfg(feature = "cuda")]
pub mod gpu;
mod health;
mod http_client;
mod load;
mod metrics;
mod pipeline;
mod publish;
mod registration;
mod server;
pub mod sidecar;
mod trace;
pub mod translate;

pub use agent::{AgentHandle, start};
pub use config::{AgentConfig, EngineKind, InboundConfig};
pub use core::RING_CAPACITY;
pub use endpoint::rank_endpoint;
pub use error::AgentError;
pub use load::parse_load;
pub use metrics::AgentMetrics;
pub use pipeline::Pipeline;

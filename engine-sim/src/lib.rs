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
//! - `POST /v1/responses` (OpenAI Responses API): `input` as a string or a list of messages
//!   (string content or `input_text` parts), `instructions` (rendered as a leading system
//!   message), `max_output_tokens` (default 16), `stream` (`event: NAME` / `data:` SSE events
//!   from `response.created` through one `response.output_text.delta` per token to
//!   `response.completed`, each with `type` and `sequence_number`, no `[DONE]`). Rendered with
//!   the chat template and scheduled like a chat request.
//! - `POST /v1/embeddings`: deterministic unit vectors seeded by the input tokens.
//! - `GET /v1/models`, `GET /health`, `GET /metrics`.
//! - LoRA adapters as vLLM serves them ([`SimConfig::lora_modules`], `--lora-modules`,
//!   `--enable-lora`): `POST /v1/load_lora_adapter` (`{"lora_name", "lora_path",
//!   "load_inplace"?}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`), always served
//!   (vLLM needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`); `/v1/models` lists each adapter after
//!   the base model (`root` its path, `parent` the base model). A request whose `model` names an
//!   adapter runs with it: responses carry the adapter's name, and its KV blocks hash apart
//!   from the base model's and every other adapter's ([`hashing`]).
//! - For third-party routers: `GET /healthz`, `/readiness`, `/health_generate`,
//!   `/get_server_info`, `/server_info`, `/get_model_info`, `/model_info`, and SGLang's
//!   `POST /generate`.
//! - Admin: `POST /reset_prefix_cache`.
//!
//! Every response carries `x-engine-id: <ip:port>`. Metrics are labelled `engine="<i>"`, the
//! engine's index in its process ([`spawn_engines`]; 0 for [`spawn`]).
//!
//! # Data-parallel ranks
//! With [`SimConfig::dp_ranks`] `N` > 1 (`--dp-ranks`, vLLM's `--data-parallel-size` behind
//! one API server) an engine runs N engine cores, each with its own KV cache, scheduler and
//! KV event sockets (rank `r` at the configured ports plus `r`, its batches carrying `r`).
//! `X-data-parallel-rank` picks the rank of a completions or chat request as vLLM 0.32 reads
//! it (an unreadable value is ignored; one out of range is vLLM's 400); without it vLLM's DP
//! load balancer places each sequence. `/metrics` shows each family once, a series per rank
//! labelled `engine="<i·N + r>"` (`<r>` for [`spawn`]).
//!
//! # KV events over ZMQ
//! With [`KvEventsConfig::endpoint`] (`--kv-events-endpoint tcp://HOST:PORT`) each engine core
//! binds a PUB socket (core `k` at `PORT + k`; port 0 picks a free port, see
//! [`EngineHandle::rank_kv_events_addr`]) and publishes vLLM's 3-frame messages
//! `[topic, seq u64 BE, msgpack [ts, [events...], dp_rank]]`, `seq` from 0 and +1 per
//! batch. Events follow the real cache: `BlockStored` when a block becomes a cached full block (prefill or
//! decode), `BlockRemoved` on eviction, `AllBlocksCleared` on `POST /reset_prefix_cache`.
//! An adapter's `BlockStored` carries its `lora_id` (vLLM's, from 1 per load) and `lora_name`.
//! With a host-memory tier ([`SimConfig::offload`], `--offload-blocks`, vLLM's
//! OffloadingConnector) every stored block is offloaded too: after the device events of the
//! same batch, one `BlockStored{medium: "CPU"}` per block (placeholder or self-describing,
//! [`OffloadEvents`]) and a `BlockRemoved{medium: "CPU"}` for the blocks the full tier evicts;
//! a prompt's blocks after its device hit that the tier holds are loaded instead of prefilled
//! and count in `cached_tokens`.
//! Encodings: legacy positional arrays or maps ([`KvEventEncoding`]); hashes as u64 or 32-byte
//! digests ([`KvEventHash`]). With [`KvEventsConfig::replay_endpoint`] a ROUTER socket answers
//! `[identity, empty, start_seq]` with every buffered batch numbered `start_seq` or later and the
//! end marker `seq = -1` with an empty payload. Publishing runs in its own task: the scheduler
//! never waits for it; a publisher that falls 4,096 batches behind skips them (their numbers
//! too, so subscribers see a gap) and counts them in
//! `kvmesh_sim_kv_event_batches_lagged_total`.
//!
//! # Test-only hooks
//! These request headers exist for tests of clients and proxies; nothing else should send them:
//! - `x-sim-delay-ms: N` delays the response headers by N milliseconds;
//! - `x-sim-status: CODE` answers HTTP status CODE with an OpenAI-shaped error body
//!   (`{"error":{"message","type","param","code"}}`) instead of handling the request.
//!
//! A request's W3C `traceparent` / `tracestate` come back on its response as
//! `x-sim-traceparent` / `x-sim-tracestate`, and `GET /sim/traceparents` lists the
//! `traceparent` of the last 64 generation requests, so tests see the trace context an engine
//! received.
//!
//! And one endpoint for tests of KV event consumers, `POST /sim/kv_events/faults` with
//! `{"drop_batches": N, "duplicate_stores": N, "restart": true}` (every field optional):
//! withhold the next N batches from the PUB socket (their numbers are used, so a gap shows;
//! replay still has them), send the first `BlockStored` of each of the next N batches holding
//! one again in a batch of its own, or simulate an engine restart (cache emptied, the next
//! batch `[AllBlocksCleared]` is numbered 0, replay buffer emptied). Faults apply to the next
//! batches the publisher handles: rank 0's, or the rank `X-data-parallel-rank` names. 400
//! when the engine does not publish KV events.
//!
//! # Disaggregated serving
//! `--role prefill|decode|both` (default both) speaks vLLM's NixlConnector protocol, as its
//! disaggregation proxies drive it: a request with `"kv_transfer_params":
//! {"do_remote_decode": true, ...}` (the prefill leg, `max_tokens: 1`, not streamed) is
//! answered with `kv_transfer_params` naming the blocks it holds (`remote_engine_id`,
//! `remote_block_ids`, `remote_host`, `remote_port`, `remote_request_id`, `tp_size`); the
//! same request with those parameters (`do_remote_prefill: true`, the decode leg) pulls the
//! blocks from that engine (`POST /sim/kv_transfer/read` there, which frees them) over this
//! engine's inbound link before its first token. A link model prices the pull: bytes per
//! block from the model's KV shape (`--kv-shape layers,kv_heads,head_dim,dtype_bytes`, Qwen3-8B
//! by default), the link's bandwidth (`--kv-link-gbps`, 64) shared fairly by concurrent
//! pulls, and iterations `--kv-transfer-interference` (0.3) slower while any runs (once, or
//! per pull in flight with `--kv-transfer-interference-scaling per-transfer`); a decode
//! engine pulls only the blocks past its own cached prefix. Blocks
//! nobody reads are freed after `--kv-hold-timeout` (30 s). Prefill and decode engines both
//! publish their KV events. Metrics: `kvmesh_sim_kv_transfers_total{outcome}`,
//! `kvmesh_sim_kv_transfer_bytes_total`, `kvmesh_sim_kv_transfer_seconds_total`,
//! `kvmesh_sim_kv_transfers_in_flight`, `kvmesh_sim_kv_held_blocks`,
//! `kvmesh_sim_kv_holds_expired_total`.
//!
//! `--disaggregation-mode prefill|decode` ([`SglangDisaggregation`]) speaks SGLang's protocol
//! instead: both legs come at once with `bootstrap_host`, `bootstrap_port` and
//! `bootstrap_room`. A prefill engine runs a bootstrap server (`--disaggregation-bootstrap-port`,
//! [`EngineHandle::bootstrap_addr`]; SGLang's `GET /route` and `GET /health`) and answers a
//! leg (one token) once the decode engine of its room has joined and taken the KV; a decode
//! engine joins the room there, moves the KV over its link and decodes. Both refuse a request
//! without `bootstrap_room` as SGLang does (400), and time out as SGLang does (500).
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
mod endpoint;
mod engine;
mod error;
pub mod hashing;
mod histogram;
mod http;
mod kv_cache;
mod kv_events;
mod kv_transfer;
mod lora;
mod metrics;
mod output_text;
mod protocol;
mod scheduler;
mod textgen;
mod timing;
mod tokenizer;
mod zmq_events;

pub use config::{
    DEFAULT_BOOTSTRAP_PORT, DisaggregationMode, InterferenceScaling, KvEventEncoding, KvEventHash,
    KvEventsConfig, KvTransferConfig, ModelShape, OffloadConfig, OffloadEvents, PreemptionMode,
    Role, SglangDisaggregation, SimConfig,
};
pub use engine::{EngineHandle, spawn, spawn_engines};
pub use error::SimError;
pub use kv_events::{KvEvent, KvEventBatch, Medium};
pub use lora::{Lora, LoraModule};

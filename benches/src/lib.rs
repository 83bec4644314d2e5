//! kvmesh-bench: a load generator for OpenAI-compatible HTTP endpoints.
//!
//! Closed loop (fixed connections sending back to back) or open loop (Poisson arrivals with a
//! bound on outstanding requests), HTTP/1.1 keep-alive or HTTP/2 (h2c), streaming-aware: SSE
//! `data:` lines are scanned as they arrive to time the first token and the gaps between
//! tokens. Workloads: one fixed prompt, a Mooncake trace replayed at its arrival times
//! ([`trace`]), or synthetic multi-turn chat ([`chat`]). With the engines' URLs it reads their
//! prefix-cache counters before and after ([`engine_metrics`]) and compares the fleet's hit
//! rate with an oracle's ([`oracle`]). Results go to a table and, optionally, a JSON file. The
//! benchmark scripts beside this crate (`overhead.sh`, `engine-sim.sh`, `routing-quality.sh`)
//! drive it.

pub mod arrival;
pub mod cache_report;
pub mod chat;
pub mod cli;
pub mod client;
pub mod closed_loop;
pub mod connection;
pub mod engine_metrics;
pub mod error_kind;
pub mod histogram;
pub mod lane;
pub mod open_loop;
pub mod oracle;
pub mod oracle_input;
pub mod plan;
pub mod process_cpu;
pub mod prompt;
pub mod recorder;
pub mod report;
pub mod rng;
pub mod run;
pub mod scan;
pub mod scheduled;
pub mod sse;
pub mod stream_progress;
pub mod target;
pub mod trace;
pub mod workload;

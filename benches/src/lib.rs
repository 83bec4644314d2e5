//! kvmesh-bench: a load generator for OpenAI-compatible HTTP endpoints.
//!
//! Closed loop (fixed connections sending back to back) or open loop (Poisson arrivals with a
//! bound on outstanding requests), HTTP/1.1 keep-alive or HTTP/2 (h2c), streaming-aware: SSE
//! `data:` lines are scanned as they arrive to time the first token and the gaps between
//! tokens. Results go to a table and, optionally, a JSON file. The benchmark scripts beside
//! this crate (`overhead.sh`, `engine-sim.sh`) drive it.

pub mod arrival;
pub mod cli;
pub mod client;
pub mod closed_loop;
pub mod connection;
pub mod error_kind;
pub mod histogram;
pub mod lane;
pub mod open_loop;
pub mod plan;
pub mod process_cpu;
pub mod prompt;
pub mod recorder;
pub mod report;
pub mod rng;
pub mod run;
pub mod scan;
pub mod sse;
pub mod stream_progress;
pub mod target;
pub mod workload;

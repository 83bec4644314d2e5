//! The HTTP front end: HTTP/1.1 and h2c on one port, routing, handlers.

mod body;
mod bootstrap;
mod dp_rank;
mod embeddings;
mod error;
mod generation;
mod info;
mod kv_event_sources;
mod kv_faults;
mod kv_read;
mod lora;
mod openai;
mod responses;
mod router;
mod server;
mod sglang;
mod sglang_pd;
mod sse;
mod state;
mod tokenize;
mod transcription;

pub(crate) use server::{serve, serve_bootstrap};
pub(crate) use state::{EngineState, RankParts};

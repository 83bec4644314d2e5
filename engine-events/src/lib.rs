//! kvmesh-engine-events: the KV event batches an engine publishes (the msgpack payload frame
//! of its ZMQ `KVEventBatch` messages), decoded: vLLM's and SGLang's, in both encodings
//! (positional arrays and maps), with both hash forms (integers, and byte strings folded by
//! [`fold_hash_bytes`]). Events of other KV groups and media are kept as
//! [`EngineEvent::Ignored`], events that cannot be read are skipped and counted, and a message
//! that cannot be walked is refused: never a panic, whatever the bytes.
//!
//! TensorRT-LLM's events, a JSON array that trtllm-serve's `POST /kv_cache_events` returns,
//! are read by [`decode_trtllm_events`] and turned into the same [`EngineEvent`]s by
//! [`TrtllmView`].
//!
//! It does no I/O and depends only on `rmp` and `serde_json`: the agent (`kvmesh-agent`) receives the frames
//! and translates the events; `fuzz/` fuzzes [`decode_batch`] (docs/fuzzing.md).

#![warn(missing_docs)]

mod batch;
mod msgpack;
mod trtllm;

pub use batch::{
    EngineBatch, EngineEvent, IgnoreReason, Layout, decode_batch, fold_hash_bytes, medium_tier,
};
pub use trtllm::{
    TrtllmBlock, TrtllmData, TrtllmEvent, TrtllmPoll, TrtllmStep, TrtllmView, decode_trtllm_events,
};

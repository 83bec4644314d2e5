//! The engine side: receiving vLLM / SGLang KV event messages over ZMQ with sequence
//! tracking (decoded by `kvmesh-engine-events`), and replaying missed ones from the engine's
//! ROUTER socket; polling TensorRT-LLM's KV cache events over HTTP.

pub(crate) mod intake;
pub(crate) mod replay;
mod sequence;
pub(crate) mod trtllm;

pub use sequence::{SeqAction, SeqTracker};

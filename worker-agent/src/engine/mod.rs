//! The engine side: decoding vLLM / SGLang KV event messages, receiving them over ZMQ with
//! sequence tracking, and replaying missed ones from the engine's ROUTER socket.

pub mod batch;
pub(crate) mod intake;
mod msgpack;
pub(crate) mod replay;
mod sequence;

pub use sequence::{SeqAction, SeqTracker};

//! kvmesh-wire: what the proxy reads off its wires besides HTTP/1.1 heads (`kvmesh-h1`), as
//! plain functions over bytes and messages, with no I/O and no runtime, so that they can be
//! fuzzed on their own (`fuzz/`, docs/fuzzing.md):
//!
//! - from engines: server-sent events, counted as they pass ([`sse`]) or read event by event
//!   ([`sse_events`]); the token usage an answer reports ([`usage`]); the OpenAI completion
//!   JSON of an answer, a streamed chunk or an error body ([`engine_json`]);
//! - from KServe v2 gRPC clients: a `ModelInferRequest`'s tensors and parameters, and the
//!   OpenAI completion request it becomes ([`kserve`]);
//! - from gateways that ask the endpoint picker: Envoy `ext_proc` messages, and the request
//!   they carry ([`ext_proc`]).
//!
//! The proxy (`kvmesh-proxy`) does the I/O around them.

#![warn(missing_docs)]

pub mod engine_json;
pub mod ext_proc;
pub mod kserve;
pub mod sse;
pub mod sse_events;
pub mod usage;

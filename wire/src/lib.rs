//! kvmesh-wire: what kvmesh reads off its wires besides HTTP/1.1 heads (`kvmesh-h1`) and the
//! control plane's messages (`kvmesh-control`), as plain functions over bytes and messages,
//! with no I/O and no runtime, so that they can be fuzzed on their own (`fuzz/`,
//! docs/fuzzing.md):
//!
//! - from clients: the fields the proxy reads of an OpenAI request body, `model` and
//!   `stream`, and the body with its model renamed ([`request_fields`]);
//! - from engines: server-sent events, counted as they pass ([`sse`]) or read event by event
//!   ([`sse_events`]); the token usage an answer reports ([`usage`]); the OpenAI completion
//!   JSON of an answer, a streamed chunk or an error body ([`engine_json`]); a streamed
//!   chunk's one choice, read without parsing the chunk ([`choice_scan`]);
//! - from engines' metrics and server info (read by the agent): a Prometheus text exposition
//!   ([`prom_text`]), the load it states ([`engine_load`]) and the KV cache shape an engine
//!   states there or in SGLang's `/get_server_info` ([`cache_config`]);
//! - from KServe v2 gRPC clients: a `ModelInferRequest`'s tensors and parameters, and the
//!   OpenAI completion request it becomes ([`kserve`]);
//! - from gateways that ask the endpoint picker: Envoy `ext_proc` messages, and the request
//!   they carry ([`ext_proc`]).
//!
//! The proxy (`kvmesh-proxy`) and the agent (`kvmesh-agent`) do the I/O around them.

#![warn(missing_docs)]

pub mod cache_config;
pub mod choice_scan;
pub mod engine_json;
pub mod engine_load;
pub mod ext_proc;
pub mod kserve;
pub mod prom_text;
pub mod request_fields;
pub mod sse;
pub mod sse_events;
pub mod usage;

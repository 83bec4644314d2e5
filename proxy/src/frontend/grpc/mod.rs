//! The KServe v2 / Open Inference Protocol gRPC frontend (`GRPCInferenceService`, with
//! `grpc.health.v1` and server reflection) on its own listener (`grpc.address`).
//!
//! It shares the one [`crate::state::shared::State`] with the OpenAI HTTP listeners: models and
//! aliases, routing (KV-aware included), failover, limits and metrics. ModelInfer and
//! ModelStreamInfer requests become OpenAI `/v1/completions` requests
//! ([`kvmesh_wire::kserve`]): `text_input` or `input_ids` is the prompt, `streaming` asks for
//! a stream, request parameters (or the `sampling_parameters` input) give the sampling
//! fields. Each goes through the spine ([`crate::request`]) as an HTTP request does
//! ([`infer`]), and the engine's JSON or server-sent events come back as
//! `ModelInferResponse`s with `text_output` and `finish_reason` ([`frontend`]).
//! ModelStreamInfer runs the requests of a stream concurrently ([`stream`]).
//!
//! The edge checks apply as on HTTP: the API key (`authorization: Bearer` metadata), its
//! limits and the model's concurrency limit. Failures map to gRPC codes
//! ([`failure`]): unknown model NOT_FOUND, malformed tensor or parameter INVALID_ARGUMENT,
//! no instance UNAVAILABLE, every instance busy or a limit reached RESOURCE_EXHAUSTED,
//! deadline DEADLINE_EXCEEDED, engine failure INTERNAL, missing or unknown key
//! UNAUTHENTICATED. A client that cancels, or whose `grpc-timeout` passes, drops its
//! engine request.

mod call;
mod catalog;
mod deadline;
mod failure;
mod frontend;
pub(crate) mod incoming;
mod infer;
mod outputs;
mod rpc_record;
mod server;
mod service;
mod stream;

pub(crate) use server::GrpcListener;

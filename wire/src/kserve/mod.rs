//! KServe v2 / Open Inference Protocol requests as the proxy's gRPC listener reads them: a
//! `ModelInferRequest`'s input tensors ([`tensors`]) and sampling parameters ([`params`]),
//! and the OpenAI `/v1/completions` request they become ([`completion`]); what is malformed
//! is an [`invalid::InvalidInput`] naming the tensor or parameter at fault.

pub mod completion;
pub mod invalid;
pub mod params;
pub mod tensors;

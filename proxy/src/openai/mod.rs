//! The lowest layer: the shapes of the API the proxy serves (OpenAI's), which every layer
//! above speaks: its errors, routes, headers, and the published OpenAPI document.
//! (Server-sent events, token usage and the body fields the proxy reads, `model` and
//! `stream`, are read by `kvmesh-wire`.)

pub(crate) mod api_error;
pub(crate) mod engine_model;
pub(crate) mod headers;
pub(crate) mod openapi;
pub(crate) mod route;

//! The lowest layer: the shapes of the API the proxy serves (OpenAI's), which every layer
//! above speaks: its errors, routes, headers, the body fields the proxy reads, and the
//! published OpenAPI document. (Server-sent events and token usage are read by
//! `kvmesh-wire`.)

pub(crate) mod api_error;
pub(crate) mod engine_model;
pub(crate) mod headers;
pub(crate) mod openapi;
pub(crate) mod request_fields;
pub(crate) mod route;

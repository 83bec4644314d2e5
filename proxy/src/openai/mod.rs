//! The lowest layer: the shapes of the API the proxy serves (OpenAI's), which every layer
//! above speaks: its errors, routes, headers, the body fields the proxy reads, server-sent
//! events, token usage, and the published OpenAPI document.

pub(crate) mod api_error;
pub(crate) mod headers;
pub(crate) mod openapi;
pub(crate) mod request_fields;
pub(crate) mod route;
pub(crate) mod sse;
pub(crate) mod usage;

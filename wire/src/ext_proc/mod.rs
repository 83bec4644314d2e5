//! Envoy's `ext_proc` protocol as the endpoint picker speaks it (the Gateway API Inference
//! Extension's endpoint picker protocol): the messages it reads and answers with
//! ([`messages`]), and the request a stream's first messages carry ([`request`]).

pub mod messages;
pub mod request;

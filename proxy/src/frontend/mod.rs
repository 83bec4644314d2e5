//! What talks to clients: the accept loop, the HTTP/1.1 fast path, the pingora data
//! listener, the KServe gRPC listener and the endpoint picker; each parses its protocol,
//! reads the body and calls the request spine.

pub(crate) mod accept;
pub(crate) mod data_app;
pub(crate) mod epp;
pub(crate) mod grpc;
pub(crate) mod h1;
pub(crate) mod request_body;
pub(crate) mod respond;

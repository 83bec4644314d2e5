//! The fast path's front end: our own HTTP/1.1 for the common case, where pingora's general
//! machinery costs more than the work itself, on plaintext client connections of the data
//! listeners ([`server`]). Its requests go to plaintext HTTP/1.1 engines through the
//! keep-alive client of `kvmesh_h1`, the crate that also holds the codec these modules use
//! (heads parsed in place, body framing, field helpers). The request head and body go to
//! the engine in one write and the response head and body to the client in one write.
//! Request bodies framed by length or chunked are read here (chunked ones by the strict
//! decoder of `kvmesh_h1::body`, forwarded with their length), and heads that break
//! RFC 9112's framing, `Host` or target rules are refused here with 400. Anything else
//! (TLS, h2c, `Expect`, other routes, heads the limits or the parser refuse) is handed to
//! pingora with the bytes already read.

pub(crate) mod client;
pub(crate) mod response;
pub(crate) mod server;

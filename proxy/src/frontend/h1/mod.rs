//! The fast path's front end: our own HTTP/1.1 for the common case, where pingora's general
//! machinery costs more than the work itself, on the data listeners' HTTP/1.1 client
//! connections, plaintext or TLS ([`server`], over [`io::ClientIo`]). Its requests go to
//! plaintext HTTP/1.1 engines through the keep-alive client of `kvmesh_h1`, the crate that also
//! holds the codec these modules use (heads parsed in place, body framing, field helpers). The
//! request head and body go to the engine in one write and the response head and body to the
//! client in one write. Request bodies framed by length or chunked are read here (chunked ones
//! by the strict decoder of `kvmesh_h1::body`, forwarded with their length), and heads that
//! break RFC 9112's framing, `Host` or target rules are refused here with 400. Anything else
//! (h2 and h2c, HTTP/1.0, expectations but `100-continue`, other routes, heads the limits or
//! the parser refuse) is handed to pingora with the bytes already read.

pub(crate) mod client;
pub(crate) mod io;
pub(crate) mod response;
pub(crate) mod server;

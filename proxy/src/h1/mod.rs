//! Our own HTTP/1.1 for the common case, where pingora's general machinery costs more than
//! the work itself: plaintext client connections on the data listeners ([`server`]) and
//! plaintext HTTP/1.1 engines ([`upstream`]). Heads are parsed in place, the request head
//! and body go to the engine in one write and the response head and body to the client in
//! one write. Anything else (TLS, h2c, `Expect`, chunked request bodies, other routes,
//! heads the limits refuse) is handed to pingora with the bytes already read.

pub(crate) mod client;
pub(crate) mod response;
pub(crate) mod server;
pub(crate) mod upstream;

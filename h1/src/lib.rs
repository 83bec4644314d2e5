//! kvmesh-h1: HTTP/1.1 as kvmesh speaks it on its fast paths, over plain TCP.
//!
//! - [`head`]: request and response heads parsed in place (httparse finds the fields, a
//!   head keeps their positions in its own bytes), with the fields a proxy looks at
//!   ([`head::Known`]) found once per head.
//! - [`body`]: reading a body by its framing: `Content-Length`, chunked transfer coding
//!   (held to RFC 9112's grammar), or until the connection closes.
//! - [`strict`]: what a head must be before its body is read: one unambiguous framing,
//!   and for requests one `Host` and a target in one of its forms. Ambiguity is refused.
//! - [`fields`]: what header fields mean between hops: hop-by-hop and end-to-end fields,
//!   `Connection` tokens, event-stream content types.
//! - [`digits`]: numbers written into heads and chunk-size lines.
//! - [`client`]: the keep-alive client of HTTP/1.1 engines: a pool of idle connections per
//!   engine and one [`client::Roundtrip`] (a request and its response) at a time on each.
//! - [`waits`]: what a server connection waits on while it reads a request head (the head
//!   deadline and the shutdown signal).
//! - [`linger`]: closing a server connection the client may still be writing to, so that
//!   it reads the answer that came early.
//!
//! Deadlines that keep moving later (per request on a keep-alive connection) run on a timer
//! that is re-armed lazily, so a busy connection touches tokio's timer wheel about once per
//! timeout period.
//!
//! The proxy's HTTP/1.1 fast path is built on it (client connections on the data listeners,
//! plaintext HTTP/1.1 engines). It depends on no other kvmesh crate.

#![warn(missing_docs)]

pub mod body;
pub mod client;
pub mod digits;
pub mod fields;
#[cfg(test)]
mod fuzz;
pub mod head;
mod lazy_timer;
pub mod linger;
pub mod strict;
pub mod waits;

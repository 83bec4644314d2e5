//! kvmesh-h1: HTTP/1.1 as kvmesh speaks it on its fast paths, over plain TCP.
//!
//! - [`head`]: request and response heads parsed in place (httparse finds the fields, a
//!   head keeps their positions in its own bytes), with the fields a proxy looks at
//!   ([`head::Known`]) found once per head.
//! - [`body`]: reading a body by its framing: `Content-Length`, chunked transfer coding, or
//!   until the connection closes.
//! - [`fields`]: what header fields mean between hops: hop-by-hop and end-to-end fields,
//!   `Connection` tokens, event-stream content types.
//! - [`digits`]: numbers written into heads and chunk-size lines.
//! - [`lazy_timer`]: a timer for deadlines that keep moving later, re-armed lazily.
//! - [`waits`]: what a server connection waits on while it reads a request head (the head
//!   deadline and the shutdown signal).
//!
//! The proxy's HTTP/1.1 fast path is built on it (client connections on the data listeners,
//! plaintext HTTP/1.1 engines); the worker-agent's inbound sidecar will speak it too. It
//! depends on no other kvmesh crate.

#![warn(missing_docs)]

pub mod body;
pub mod digits;
pub mod fields;
#[cfg(test)]
mod fuzz;
pub mod head;
pub mod lazy_timer;
pub mod waits;

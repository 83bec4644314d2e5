//! The client side of a proxied request, as the spine ([`crate::request`]) sees it: the
//! head the engine request is built from, a signal that the client left, and where errors
//! and the engine's answer go. Each front end implements [`Frontend`]: the fast path
//! (`h1::client`), pingora's HTTP sessions (`data_app`) and the KServe gRPC listener
//! (`grpc::frontend`).

use std::future::Future;

use bytes::Bytes;

use crate::engines::upstream_session::UpstreamSession;
use crate::metrics::failure::FailureKind;
use crate::metrics::families::Metrics;
use crate::openai::api_error::ApiError;
use crate::openai::headers::{ClientFraming, EngineHead, EngineTarget, InvalidHead, ProxyHeaders};
use crate::request::body::PieceError;
use crate::request::record::Record;

/// Writes `request` as an HTTP/1.1 head.
pub(crate) fn write_request_head(request: &EngineHead, out: &mut Vec<u8>) {
    out.extend_from_slice(request.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(request.path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &request.headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// A front end's client of one proxied request: where it came from and where its answer
/// goes. Front ends parse and write; everything in between is the spine's.
pub(crate) trait Frontend: Send {
    /// The engine request's head (for the transports that take a head: h2c and `https://`
    /// engines).
    fn engine_request(&self, target: &EngineTarget<'_>) -> Result<EngineHead, InvalidHead>;

    /// The engine request's head written as HTTP/1.1 into `out`, for plaintext HTTP/1.1
    /// engines.
    fn write_engine_request(
        &self,
        target: &EngineTarget<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), InvalidHead> {
        write_request_head(&self.engine_request(target)?, out);
        Ok(())
    }

    /// The value of the client's request header `name` (case-insensitive), when present
    /// and valid UTF-8.
    fn header(&self, name: &str) -> Option<&str>;

    /// The query of the client's request target (after `?`), when it has one.
    fn query(&self) -> Option<&str>;

    /// Completes when the client has gone away; stays pending while it waits (and while a
    /// streamed body is still to be read: a client gone shows when its next piece is read).
    fn gone(&mut self) -> impl Future<Output = ()> + Send;

    /// The next piece of a streamed body ([`crate::request::body`]); `Ok(None)` at its end.
    /// Front ends that never stream a body keep this default.
    fn read_body_piece(
        &mut self,
    ) -> impl Future<Output = Result<Option<Bytes>, PieceError>> + Send {
        async { Ok(None) }
    }

    /// Answers with a proxy-generated error; returns whether the client can still be
    /// served (an HTTP connection reused).
    fn reject(
        &mut self,
        record: &mut Record,
        metrics: &Metrics,
        error: &ApiError,
    ) -> impl Future<Output = bool> + Send;

    /// Starts the answer to the engine's response, whose head `engine` has read (with the
    /// proxy's own fields `ours`), and says how its body is framed towards the client.
    /// `Err`: the relay cannot start (the engine's head cannot be relayed, or the client
    /// is gone).
    fn start_response(
        &mut self,
        engine: &UpstreamSession,
        ours: ProxyHeaders<'_>,
    ) -> impl Future<Output = Result<ClientFraming, Unrelayable>> + Send;

    /// Writes a piece of the response body (`end`: the last one); `false` when the client
    /// is gone. Server-sent events arrive whole, except one larger than the relay holds.
    fn write_body(&mut self, data: Bytes, end: bool) -> impl Future<Output = bool> + Send;

    /// The engine broke off mid-body: ends the client's answer as its protocol allows,
    /// with `error_event` when the relay made one (an SSE stream with open framing).
    /// Returns whether the answer ended cleanly (else the connection or stream is cut).
    fn end_broken(
        &mut self,
        kind: FailureKind,
        error_event: Option<Bytes>,
    ) -> impl Future<Output = bool> + Send {
        let _ = kind;
        async move {
            match error_event {
                Some(event) => self.write_body(event, true).await,
                None => false,
            }
        }
    }
}

/// Runs `work` unless `frontend`'s client leaves first (`None`).
pub(crate) async fn unless_gone<F: Frontend, T>(
    frontend: &mut F,
    work: impl Future<Output = T>,
) -> Option<T> {
    unless(frontend.gone(), work).await
}

/// Runs `work` unless `gone` completes first (`None`): the client left.
pub(crate) async fn unless<T>(
    gone: impl Future<Output = ()>,
    work: impl Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        output = work => Some(output),
        () = gone => None,
    }
}

/// Why a response could not be started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unrelayable {
    /// The engine's response head cannot be relayed.
    EngineHead,
    /// The client went away.
    ClientGone,
}

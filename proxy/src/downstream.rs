//! The client side of a forwarded request, as [`crate::forward`] sees it: the head the
//! engine request is built from, a signal that the client left, and where errors and the
//! engine's answer go. [`HttpDownstream`] is the OpenAI HTTP listener's; the gRPC
//! listener has its own (`grpc::downstream`).

use std::future::Future;

use bytes::Bytes;
use http::HeaderValue;
use pingora_core::protocols::http::ServerSession;
use pingora_http::RequestHeader;

use crate::api_error::ApiError;
use crate::exchange::Exchange;
use crate::failure::FailureKind;
use crate::forward::Answer;
use crate::headers::{ProxyHeaders, downstream_response, upstream_request};
use crate::metrics::Metrics;
use crate::pool::ModelPool;
use crate::relay::{BodySink, RelayContext, RelayEnd, relay};
use crate::state::State;
use crate::upstream_session::UpstreamSession;

/// What the engine request adds to the client's: the engine's `Host`, the body's length
/// and the request id.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UpstreamTarget<'a> {
    /// `Host` of the engine.
    pub(crate) host: &'a HeaderValue,
    /// Length of the body sent.
    pub(crate) body_len: usize,
    /// `x-request-id`.
    pub(crate) request_id: &'a HeaderValue,
}

/// Writes `request` as an HTTP/1.1 head.
pub(crate) fn write_request_head(request: &RequestHeader, out: &mut Vec<u8>) {
    out.extend_from_slice(request.method.as_str().as_bytes());
    out.push(b' ');
    let target = request
        .uri
        .path_and_query()
        .map_or("/", |path| path.as_str());
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &request.headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Where one forwarded request came from and where its answer goes.
pub(crate) trait Downstream: Send {
    /// The engine request's head, for pingora's client (h2c and `https://` engines).
    fn upstream_request(&self, target: &UpstreamTarget<'_>)
    -> pingora_error::Result<RequestHeader>;

    /// The engine request's head written as HTTP/1.1 into `out`, for plaintext HTTP/1.1
    /// engines.
    fn write_upstream_request(
        &self,
        target: &UpstreamTarget<'_>,
        out: &mut Vec<u8>,
    ) -> pingora_error::Result<()> {
        write_request_head(&self.upstream_request(target)?, out);
        Ok(())
    }

    /// Completes when the client has gone away; stays pending while it waits.
    fn gone(&mut self) -> impl Future<Output = ()> + Send;

    /// Answers with a proxy-generated error; returns whether the client can still be
    /// served (an HTTP connection reused).
    fn reject(
        &mut self,
        exchange: &mut Exchange,
        metrics: &Metrics,
        error: &ApiError,
    ) -> impl Future<Output = bool> + Send;

    /// Relays the engine's answer, whose response head `upstream` has read.
    fn relay(
        &mut self,
        state: &State,
        pool: &ModelPool,
        answer: &Answer<'_>,
        upstream: &mut UpstreamSession,
        exchange: &mut Exchange,
    ) -> impl Future<Output = RelayEnd> + Send;
}

/// A request on an OpenAI HTTP listener: the engine's answer is relayed as it is.
pub(crate) struct HttpDownstream<'a> {
    session: &'a mut ServerSession,
}

impl<'a> HttpDownstream<'a> {
    /// The client of `session`.
    pub(crate) fn new(session: &'a mut ServerSession) -> Self {
        Self { session }
    }
}

impl Downstream for HttpDownstream<'_> {
    fn upstream_request(
        &self,
        target: &UpstreamTarget<'_>,
    ) -> pingora_error::Result<RequestHeader> {
        upstream_request(self.session.req_header(), target)
    }

    async fn gone(&mut self) {
        let _ = self.session.read_body_or_idle(true).await;
    }

    async fn reject(
        &mut self,
        exchange: &mut Exchange,
        metrics: &Metrics,
        error: &ApiError,
    ) -> bool {
        exchange.reject(self.session, metrics, error).await
    }

    /// Writes the engine's response head (with the proxy's headers) and relays its body.
    async fn relay(
        &mut self,
        state: &State,
        pool: &ModelPool,
        answer: &Answer<'_>,
        upstream: &mut UpstreamSession,
        exchange: &mut Exchange,
    ) -> RelayEnd {
        let session = &mut *self.session;
        let Some(upstream_header) = upstream.response_header() else {
            return RelayEnd::UpstreamFailed {
                kind: FailureKind::Reset,
                clean: false,
            };
        };
        let event_stream = upstream.is_event_stream();
        let ours = ProxyHeaders {
            instance: answer.instance.instance_header(),
            request_id: &exchange.request_id,
            route: answer.route,
        };
        let client_version = session.req_header().version;
        let built = downstream_response(&upstream_header, ours, client_version, session.is_http2());
        drop(upstream_header);
        let Ok((response, framing)) = built else {
            return RelayEnd::UpstreamFailed {
                kind: FailureKind::Reset,
                clean: false,
            };
        };
        if session
            .write_response_header(Box::new(response))
            .await
            .is_err()
        {
            return RelayEnd::ClientGone;
        }
        let ctx = RelayContext {
            started: exchange.started,
            idle_timeout: state.limits.idle_timeout,
            event_stream,
            framing,
            metrics: pool.metrics(),
            booking: answer.booking,
            meter: exchange.meter.as_ref(),
        };
        relay(session, upstream, &ctx).await
    }
}

impl BodySink for ServerSession {
    async fn write_body(&mut self, data: Bytes, end: bool) -> bool {
        self.write_response_body(data, end).await.is_ok()
    }

    async fn client_gone(&mut self) {
        let _ = self.read_body_or_idle(true).await;
    }
}

//! The client side of a forwarded request, as [`crate::forward`] sees it: the head the
//! engine request is built from, a signal that the client left, and where errors and the
//! engine's answer go. [`HttpDownstream`] is the OpenAI HTTP listener's; the gRPC
//! listener has its own (`grpc::downstream`).

use std::future::Future;

use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::http::client::HttpSession;
use pingora_http::RequestHeader;

use crate::api_error::ApiError;
use crate::exchange::Exchange;
use crate::failure::FailureKind;
use crate::forward::Answer;
use crate::headers::{ProxyHeaders, downstream_response, is_event_stream};
use crate::metrics::Metrics;
use crate::pool::ModelPool;
use crate::relay::{RelayContext, RelayEnd, relay};
use crate::state::State;

/// Where one forwarded request came from and where its answer goes.
pub(crate) trait Downstream: Send {
    /// The request head the engine request is built from (method, path and the end-to-end
    /// headers to pass on).
    fn head(&self) -> &RequestHeader;

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
        upstream: &mut HttpSession,
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
    fn head(&self) -> &RequestHeader {
        self.session.req_header()
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
        upstream: &mut HttpSession,
        exchange: &mut Exchange,
    ) -> RelayEnd {
        let session = &mut *self.session;
        let Some(upstream_header) = upstream.response_header() else {
            return RelayEnd::UpstreamFailed {
                kind: FailureKind::Reset,
                clean: false,
            };
        };
        let event_stream = is_event_stream(upstream_header);
        let ours = ProxyHeaders {
            instance: answer.instance.instance_header(),
            request_id: &exchange.request_id,
            route: answer.route,
        };
        let client_version = session.req_header().version;
        let built = downstream_response(upstream_header, ours, client_version, session.is_http2());
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

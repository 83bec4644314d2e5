//! The pingora front end of the data listeners (h2 over TLS, h2c, and HTTP/1 the fast path
//! hands over): pingora drives it once per request (HTTP/1.1 keep-alive and h2c streams alike).
//! It checks the head, matches the route, authenticates, answers the routes the proxy
//! serves itself, reads the body and hands proxied requests to the spine
//! ([`crate::request::proxy`]) through [`PingoraClient`].
//!
//! HTTP/1 heads are held to RFC 9112 ([`kvmesh_h1::strict`]) as the fast path holds them,
//! on the head as it was sent (pingora drops a `Content-Length` that comes with
//! `Transfer-Encoding` and goes on; kvmesh answers 400). Pingora decodes chunked bodies
//! itself, more leniently than kvmesh's decoder, so a connection closes after a chunked
//! request: nothing after a body it read one way is taken for a next request. A request
//! answered before its body was read ends its HTTP/1 connection with a lingering close.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use kvmesh_h1::head::{Parsed, parse_request};
use kvmesh_h1::linger::lingering_close;
use kvmesh_h1::strict::{Violation, request_framing};
use pingora_core::apps::{
    HttpPersistentSettings, HttpServerApp, HttpServerOptions, ReusedHttpStream,
};
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;

use crate::edge::auth::{ApiKey, AuthFailure};
use crate::edge::edge_metrics::Peer;
use crate::edge::limits::{
    HeadRead, answer_unread_head, check_head, malformed_head_error, read_head,
};
use crate::engines::upstream_session::UpstreamSession;
use crate::frontend::request_body::{BodyError, read_body_start, read_piece};
use crate::frontend::respond::{JSON, reject, respond};
use crate::metrics::families::Metrics;
use crate::openai::api_error::{ApiError, ClientErrorReason};
use crate::openai::engine_model::MULTIPART_WINDOW;
use crate::openai::headers::{
    ClientFraming, ProxyHeaders, X_REQUEST_ID, content_length, downstream_response,
    expects_continue, upstream_request,
};
use crate::openai::headers::{EngineHead, EngineTarget, InvalidHead};
use crate::openai::openapi;
use crate::openai::route::{Route, RouteMatch, match_route};
use crate::request::body::{BodyRest, PieceError, RequestBody, StreamedRead, streams};
use crate::request::frontend::{Frontend, Unrelayable};
use crate::request::proxy;
use crate::request::record::Record;
use crate::state::shared::State;

/// Marks an HTTP/1 connection that already served a request (a head timeout on
/// it is an idle keep-alive connection, not a slow client).
struct KeptAlive;

/// How a connection goes on after a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    /// Pingora finishes the response and keeps the connection when it can.
    Finish,
    /// Closed at once: the client is gone, or the response broke off.
    Close,
    /// The answer came before the request body was read: an HTTP/1 connection closes with
    /// a lingering close (an h2 stream just finishes).
    Linger,
}

impl After {
    /// After an answer that was written (`Finish`) or not (`Close`).
    fn written(written: bool) -> Self {
        if written { Self::Finish } else { Self::Close }
    }
}

/// Serves the OpenAI routes of a data listener.
#[derive(Debug)]
pub(crate) struct DataApp {
    /// The current state (replaced by reloads); each request loads it once.
    state: Arc<ArcSwap<State>>,
    options: Option<HttpServerOptions>,
}

impl DataApp {
    /// The app; `h2c` makes pingora speak HTTP/2 to clients that open with
    /// the h2 preface.
    pub(crate) fn new(state: Arc<ArcSwap<State>>, h2c: bool) -> Self {
        let options = h2c.then(|| {
            let mut options = HttpServerOptions::default();
            options.h2c = true;
            options
        });
        Self { state, options }
    }
}

#[async_trait]
impl HttpServerApp for DataApp {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        let fresh = session.take_connection_user_context().is_none();
        let head_timeout = self.state.load().limits.client_header_timeout;
        match read_head(&mut session, head_timeout, shutdown, fresh).await {
            HeadRead::Ready => {}
            HeadRead::Closed => return None,
            HeadRead::TimedOut => {
                let state = self.state.load();
                state
                    .metrics
                    .client_error(ClientErrorReason::RequestTimeout);
                answer_unread_head(session, &ApiError::RequestTimeout).await;
                return None;
            }
            HeadRead::Malformed(error) => {
                tracing::debug!(%error, "malformed request head");
                let error = malformed_head_error(&error);
                let metrics = &self.state.load().metrics;
                if let Some(reason) = error.client_reason() {
                    metrics.client_error(reason);
                }
                if let ApiError::InvalidFraming(violation) = error {
                    metrics.edge.count_framing(Peer::Client, violation);
                }
                answer_unread_head(session, &error).await;
                return None;
            }
        }
        // The state this request runs on to its end, whatever reloads happen meanwhile.
        let state = self.state.load_full();
        if *shutdown.borrow() {
            session.set_keepalive(None);
        }
        let request_id = state.request_ids.resolve(session.get_header(X_REQUEST_ID));
        let mut record = Record::new(request_id);
        let after = handle(&state, &mut session, &mut record).await;
        let header = session.req_header();
        record.finish(&state.registry, &header.method, header.uri.path());
        match after {
            After::Finish => {}
            After::Close => {
                session.shutdown().await;
                return None;
            }
            After::Linger => {
                // Boxed: the future exists only while a connection lingers.
                Box::pin(linger(session)).await;
                return None;
            }
        }
        let mut settings = HttpPersistentSettings::for_session(&session);
        settings.set_user_context(Box::new(KeptAlive));
        match session.finish().await {
            Ok(Some(stream)) => Some(ReusedHttpStream::from_reusable_stream(stream, settings)),
            _ => None,
        }
    }

    fn server_options(&self) -> Option<&HttpServerOptions> {
        self.options.as_ref()
    }
}

/// Ends an HTTP/1 session whose request body was left unread: the answer is flushed, the
/// connection closed with a lingering close. An h2 stream just finishes.
async fn linger(session: ServerSession) {
    match session {
        ServerSession::H1(mut h1) => {
            if h1.finish_body().await.is_ok() {
                lingering_close(h1.into_inner()).await;
            }
        }
        other => {
            let _ = other.finish().await;
        }
    }
}

/// The HTTP/1 request head as it was sent, held to RFC 9112 ([`kvmesh_h1::strict`]).
/// (h2 frames its messages itself.)
fn check_framing(session: &ServerSession) -> Result<(), ApiError> {
    if session.is_http2() {
        return Ok(());
    }
    match parse_request(&mut BytesMut::from(&session.to_h1_raw()[..])) {
        Parsed::Complete(head) => request_framing(&head)
            .map(drop)
            .map_err(ApiError::InvalidFraming),
        // Pingora read a head out of these very bytes.
        Parsed::Partial | Parsed::Invalid => Err(ApiError::MalformedRequest),
    }
}

/// Answers with `error` before the request body was read; the connection then closes with
/// a lingering close when the request has a body (or `close` says so).
async fn reject_early(
    state: &State,
    session: &mut ServerSession,
    record: &mut Record,
    error: &ApiError,
    close: bool,
) -> After {
    let close = close || !session.is_body_done();
    if close {
        session.set_keepalive(None);
    }
    match reject(session, record, &state.metrics, error).await {
        false => After::Close,
        true if close => After::Linger,
        true => After::Finish,
    }
}

/// Routes and answers one request; says how the connection goes on.
async fn handle(state: &State, session: &mut ServerSession, record: &mut Record) -> After {
    if let Err(error) = check_framing(session) {
        if let ApiError::InvalidFraming(violation) = error {
            tracing::debug!(reason = violation.label(), "request framing refused");
            state.metrics.edge.count_framing(Peer::Client, violation);
        }
        return reject_early(state, session, record, &error, true).await;
    }
    let header = session.req_header();
    if let Err(error) = check_head(header, &state.limits) {
        return reject_early(state, session, record, &error, true).await;
    }
    let route = match match_route(&state.engine_routes, &header.method, header.uri.path()) {
        RouteMatch::Found(route) => route,
        RouteMatch::MethodNotAllowed(allow) => {
            let error = ApiError::MethodNotAllowed { allow };
            return reject_early(state, session, record, &error, false).await;
        }
        RouteMatch::NotFound => {
            let error = ApiError::UnknownPath {
                path: header.uri.path().to_string(),
            };
            return reject_early(state, session, record, &error, false).await;
        }
    };
    record.route = Some(route);
    let key = if matches!(route, Route::OpenApi | Route::Docs) {
        None
    } else {
        match state.auth.authenticate(session.req_header()) {
            Ok(Some(key)) => {
                // The key is the gateway's: engines never see it.
                session
                    .req_header_mut()
                    .remove_header(&http::header::AUTHORIZATION);
                Some(key)
            }
            Ok(None) => None,
            Err(failure) => {
                let missing = failure == AuthFailure::Missing;
                let error = ApiError::Unauthorized { missing };
                return reject_early(state, session, record, &error, false).await;
            }
        }
    };
    if !route.is_proxied() {
        let (content_type, body) = match route {
            Route::OpenApi => (JSON, openapi::spec()),
            Route::Docs => (openapi::HTML, openapi::docs_page()),
            _ => (JSON, state.registry.models_body()),
        };
        record.status = 200;
        let extra = [(X_REQUEST_ID, record.request_id.clone())];
        return After::written(respond(session, 200, content_type, &extra, body).await);
    }
    read_and_proxy(state, session, record, key).await
}

/// Reads the body of a proxied route (within the size limit and the client deadline) and
/// hands the request to the spine.
async fn read_and_proxy(
    state: &State,
    session: &mut ServerSession,
    record: &mut Record,
    key: Option<Arc<ApiKey>>,
) -> After {
    let limit = state.limits.max_body_bytes;
    let declared = content_length(session.req_header());
    if declared.is_some_and(|length| length > limit) {
        let error = ApiError::BodyTooLarge { limit };
        return reject_early(state, session, record, &error, true).await;
    }
    let chunked = !session.is_http2()
        && session
            .req_header()
            .headers
            .contains_key(http::header::TRANSFER_ENCODING);
    if chunked {
        // Pingora's decoder, not kvmesh's, reads the body: nothing after it is trusted.
        session.set_keepalive(None);
    }
    if expects_continue(session.req_header())
        && !session.is_http2()
        && session.write_continue_response().await.is_err()
    {
        return After::Close;
    }
    let deadline = record.started + state.limits.client_header_timeout;
    let content_type = session.req_header().headers.get(http::header::CONTENT_TYPE);
    let route = record.route.unwrap_or(Route::ChatCompletions);
    let streamed = streams(route, content_type.map(http::HeaderValue::as_bytes));
    let window = streamed.then_some(MULTIPART_WINDOW);
    let error = match read_body_start(session, limit, declared, deadline, window).await {
        Ok((body, ended)) => {
            let idle = state.limits.client_header_timeout;
            let streaming = (!ended).then(|| StreamedRead::new(body.len() as u64, limit, idle));
            let body = RequestBody {
                rest: streaming.as_ref().map(|_| BodyRest::new(declared)),
                read: body,
            };
            let mut client = PingoraClient { session, streaming };
            let proxied = proxy(state, &mut client, record, key, body).await;
            if client.streaming.is_some() {
                // Answered before the streamed body's end was read.
                client.session.set_keepalive(None);
                return if proxied { After::Linger } else { After::Close };
            }
            return After::written(proxied);
        }
        Err(BodyError::Client(error)) => {
            tracing::debug!(%error, "reading the request body failed");
            record.client_gone = true;
            return After::Close;
        }
        Err(BodyError::TooLarge) => ApiError::BodyTooLarge { limit },
        Err(BodyError::Timeout) => ApiError::RequestTimeout,
        Err(BodyError::Malformed) => {
            tracing::debug!("malformed chunked request body");
            state
                .metrics
                .edge
                .count_framing(Peer::Client, Violation::Chunk);
            ApiError::InvalidFraming(Violation::Chunk)
        }
    };
    reject_early(state, session, record, &error, true).await
}

/// A request's client on a pingora session: the engine's answer is relayed as it is.
struct PingoraClient<'a> {
    session: &'a mut ServerSession,
    /// The request body streams: how far it is read.
    streaming: Option<StreamedRead>,
}

impl PingoraClient<'_> {
    /// [`Frontend::read_body_piece`], before the connection is told to close on a failure.
    async fn next_piece(&mut self) -> Result<Option<Bytes>, PieceError> {
        let Some(streaming) = self.streaming.as_mut() else {
            return Ok(None);
        };
        let piece = read_piece(self.session, streaming.deadline())
            .await
            .map_err(|error| match error {
                BodyError::Timeout => PieceError::Timeout,
                BodyError::Malformed => PieceError::Malformed,
                BodyError::TooLarge | BodyError::Client(_) => PieceError::Gone,
            })?;
        let Some(piece) = piece else {
            self.streaming = None;
            return Ok(None);
        };
        streaming.count(piece.len())?;
        Ok(Some(piece))
    }
}

impl Frontend for PingoraClient<'_> {
    fn engine_request(&self, target: &EngineTarget<'_>) -> Result<EngineHead, InvalidHead> {
        Ok(upstream_request(self.session.req_header(), target))
    }

    fn header(&self, name: &str) -> Option<&str> {
        let value = self.session.req_header().headers.get(name)?;
        value.to_str().ok()
    }

    fn query(&self) -> Option<&str> {
        self.session.req_header().uri.query()
    }

    async fn gone(&mut self) {
        if self.streaming.is_some() {
            // The client is still sending the body the spine reads.
            return std::future::pending().await;
        }
        let _ = self.session.read_body_or_idle(true).await;
    }

    async fn read_body_piece(&mut self) -> Result<Option<Bytes>, PieceError> {
        let piece = self.next_piece().await;
        if piece.is_err() {
            self.session.set_keepalive(None);
        }
        piece
    }

    async fn reject(&mut self, record: &mut Record, metrics: &Metrics, error: &ApiError) -> bool {
        reject(self.session, record, metrics, error).await
    }

    /// Writes the engine's response head with the proxy's fields.
    async fn start_response(
        &mut self,
        engine: &UpstreamSession,
        ours: ProxyHeaders<'_>,
    ) -> Result<ClientFraming, Unrelayable> {
        let session = &mut *self.session;
        let engine_head = engine.response_header().ok_or(Unrelayable::EngineHead)?;
        let client_version = session.req_header().version;
        let built = downstream_response(&engine_head, ours, client_version, session.is_http2());
        drop(engine_head);
        let (response, framing) = built.map_err(|_| Unrelayable::EngineHead)?;
        session
            .write_response_header(Box::new(response))
            .await
            .map_err(|_| Unrelayable::ClientGone)?;
        Ok(framing)
    }

    async fn write_body(&mut self, data: Bytes, end: bool) -> bool {
        self.session.write_response_body(data, end).await.is_ok()
    }
}

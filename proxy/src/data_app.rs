//! The pingora front end of the data listeners (h2c, TLS, and HTTP/1.1 the fast path hands
//! over): pingora drives it once per request (HTTP/1.1 keep-alive and h2c streams alike).
//! It checks the head, matches the route, authenticates, answers the routes the proxy
//! serves itself, reads the body and hands proxied requests to the spine
//! ([`crate::request::proxy`]) through [`PingoraClient`].

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::apps::{
    HttpPersistentSettings, HttpServerApp, HttpServerOptions, ReusedHttpStream,
};
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;
use pingora_http::RequestHeader;

use crate::api_error::{ApiError, ClientErrorReason};
use crate::auth::{ApiKey, AuthFailure};
use crate::headers::EngineTarget;
use crate::headers::{
    ClientFraming, ProxyHeaders, X_REQUEST_ID, content_length, downstream_response,
    expects_continue, upstream_request,
};
use crate::limits::{HeadRead, answer_unread_head, check_head, malformed_head_error, read_head};
use crate::metrics::Metrics;
use crate::openapi;
use crate::request::frontend::{Frontend, Unrelayable};
use crate::request::proxy;
use crate::request::record::Record;
use crate::request_body::{BodyError, read_body};
use crate::respond::{JSON, reject, respond};
use crate::route::{Route, RouteMatch, match_route};
use crate::state::State;
use crate::upstream_session::UpstreamSession;

/// Marks an HTTP/1 connection that already served a request (a head timeout on
/// it is an idle keep-alive connection, not a slow client).
struct KeptAlive;

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
                if let Some(reason) = error.client_reason() {
                    self.state.load().metrics.client_error(reason);
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
        let reusable = handle(&state, &mut session, &mut record).await;
        let header = session.req_header();
        record.finish(&state.registry, &header.method, header.uri.path());
        if !reusable {
            session.shutdown().await;
            return None;
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

/// Routes and answers one request; returns whether the connection can be reused.
async fn handle(state: &State, session: &mut ServerSession, record: &mut Record) -> bool {
    let header = session.req_header();
    if let Err(error) = check_head(header, &state.limits) {
        session.set_keepalive(None);
        return reject(session, record, &state.metrics, &error).await;
    }
    let route = match match_route(&header.method, header.uri.path()) {
        RouteMatch::Found(route) => route,
        RouteMatch::MethodNotAllowed(allow) => {
            let error = ApiError::MethodNotAllowed { allow };
            return reject(session, record, &state.metrics, &error).await;
        }
        RouteMatch::NotFound => {
            let error = ApiError::UnknownPath {
                path: header.uri.path().to_string(),
            };
            return reject(session, record, &state.metrics, &error).await;
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
                return reject(session, record, &state.metrics, &error).await;
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
        return respond(session, 200, content_type, &extra, body).await;
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
) -> bool {
    let limit = state.limits.max_body_bytes;
    let declared = content_length(session.req_header());
    if declared.is_some_and(|length| length > limit) {
        let error = ApiError::BodyTooLarge { limit };
        return reject(session, record, &state.metrics, &error).await;
    }
    if expects_continue(session.req_header())
        && !session.is_http2()
        && session.write_continue_response().await.is_err()
    {
        return false;
    }
    let deadline = record.started + state.limits.client_header_timeout;
    let body = match read_body(session, limit, declared, deadline).await {
        Ok(body) => body,
        Err(BodyError::TooLarge) => {
            let error = ApiError::BodyTooLarge { limit };
            return reject(session, record, &state.metrics, &error).await;
        }
        Err(BodyError::Timeout) => {
            session.set_keepalive(None);
            return reject(session, record, &state.metrics, &ApiError::RequestTimeout).await;
        }
        Err(BodyError::Client(error)) => {
            tracing::debug!(%error, "reading the request body failed");
            record.client_gone = true;
            return false;
        }
    };
    proxy(state, &mut PingoraClient { session }, record, key, body).await
}

/// A request's client on a pingora session: the engine's answer is relayed as it is.
struct PingoraClient<'a> {
    session: &'a mut ServerSession,
}

impl Frontend for PingoraClient<'_> {
    fn engine_request(&self, target: &EngineTarget<'_>) -> pingora_error::Result<RequestHeader> {
        upstream_request(self.session.req_header(), target)
    }

    fn header(&self, name: &str) -> Option<&str> {
        let value = self.session.req_header().headers.get(name)?;
        value.to_str().ok()
    }

    async fn gone(&mut self) {
        let _ = self.session.read_body_or_idle(true).await;
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

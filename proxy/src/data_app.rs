//! The data listener's application: OpenAI routes, admission checks, then
//! forwarding. Pingora drives it once per request (HTTP/1.1 keep-alive and
//! h2c streams alike).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora_core::apps::{
    HttpPersistentSettings, HttpServerApp, HttpServerOptions, ReusedHttpStream,
};
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;
use tokio::time::timeout;

use crate::api_error::ApiError;
use crate::exchange::Exchange;
use crate::forward::{Picker, forward};
use crate::headers::{X_REQUEST_ID, content_length, expects_continue};
use crate::kv_route::offload;
use crate::kv_route::prepare::InvalidPrompt;
use crate::pool::Balancer;
use crate::request_body::{BodyError, read_body};
use crate::request_fields::{FieldsError, extract, with_model_name};
use crate::respond::{JSON, respond};
use crate::route::{Route, RouteMatch, match_route};
use crate::state::State;

/// How long a connection may still deliver a request head once shutdown began.
const SHUTDOWN_GRACE: Duration = Duration::from_millis(200);

/// Serves the OpenAI routes of a data listener.
#[derive(Debug)]
pub(crate) struct DataApp {
    state: Arc<State>,
    options: Option<HttpServerOptions>,
}

impl DataApp {
    /// The app; `h2c` makes pingora speak HTTP/2 to clients that open with
    /// the h2 preface.
    pub(crate) fn new(state: Arc<State>, h2c: bool) -> Self {
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
        let limits = &self.state.limits;
        if !read_head(&mut session, limits.client_header_timeout, shutdown).await {
            return None;
        }
        if *shutdown.borrow() {
            session.set_keepalive(None);
        }
        let request_id = self
            .state
            .request_ids
            .resolve(session.get_header(X_REQUEST_ID));
        let mut exchange = Exchange::new(request_id);
        let reusable = handle(&self.state, &mut session, &mut exchange).await;
        let header = session.req_header();
        exchange.finish(&self.state.registry, &header.method, header.uri.path());
        if !reusable {
            session.shutdown().await;
            return None;
        }
        let settings = HttpPersistentSettings::for_session(&session);
        match session.finish().await {
            Ok(Some(stream)) => Some(ReusedHttpStream::from_reusable_stream(stream, settings)),
            _ => None,
        }
    }

    fn server_options(&self) -> Option<&HttpServerOptions> {
        self.options.as_ref()
    }
}

/// Reads the request head within `limit`; once shutdown begins, a connection
/// gets a short grace to deliver a head already on its way, then is closed.
async fn read_head(session: &mut ServerSession, limit: Duration, shutdown: &ShutdownWatch) -> bool {
    let mut shutdown = shutdown.clone();
    let read = timeout(limit, session.read_request());
    tokio::pin!(read);
    let result = if *shutdown.borrow_and_update() {
        timeout(SHUTDOWN_GRACE, &mut read).await
    } else {
        tokio::select! {
            result = &mut read => Ok(result),
            _ = shutdown.changed() => timeout(SHUTDOWN_GRACE, &mut read).await,
        }
    };
    matches!(result, Ok(Ok(Ok(true))))
}

/// Routes and answers one request; returns whether the connection can be reused.
async fn handle(state: &State, session: &mut ServerSession, exchange: &mut Exchange) -> bool {
    let header = session.req_header();
    let route = match match_route(&header.method, header.uri.path()) {
        RouteMatch::Found(route) => route,
        RouteMatch::MethodNotAllowed(allow) => {
            let error = ApiError::MethodNotAllowed { allow };
            return exchange.reject(session, &state.metrics, &error).await;
        }
        RouteMatch::NotFound => {
            let error = ApiError::UnknownPath {
                path: header.uri.path().to_string(),
            };
            return exchange.reject(session, &state.metrics, &error).await;
        }
    };
    exchange.route = Some(route);
    if !route.is_proxied() {
        exchange.status = 200;
        let extra = [(X_REQUEST_ID, exchange.request_id.clone())];
        let body = state.registry.models_body();
        return respond(session, 200, JSON, &extra, body).await;
    }
    proxy(state, session, exchange).await
}

/// Admission (size, JSON, model) and forwarding of a proxied route.
async fn proxy(state: &State, session: &mut ServerSession, exchange: &mut Exchange) -> bool {
    let limit = state.limits.max_body_bytes;
    let declared = content_length(session.req_header());
    if declared.is_some_and(|length| length > limit) {
        return exchange
            .reject(session, &state.metrics, &ApiError::BodyTooLarge { limit })
            .await;
    }
    if expects_continue(session.req_header())
        && !session.is_http2()
        && session.write_continue_response().await.is_err()
    {
        return false;
    }
    let deadline = exchange.started + state.limits.client_header_timeout;
    let body = match read_body(session, limit, declared, deadline).await {
        Ok(body) => body,
        Err(BodyError::TooLarge) => {
            return exchange
                .reject(session, &state.metrics, &ApiError::BodyTooLarge { limit })
                .await;
        }
        Err(BodyError::Timeout) => {
            session.set_keepalive(None);
            return exchange
                .reject(session, &state.metrics, &ApiError::RequestTimeout)
                .await;
        }
        Err(BodyError::Client(error)) => {
            tracing::debug!(%error, "reading the request body failed");
            exchange.client_gone = true;
            return false;
        }
    };
    let (pool, renamed) = match extract(&body) {
        Err(FieldsError::InvalidJson(detail)) => {
            return exchange
                .reject(session, &state.metrics, &ApiError::InvalidJson(detail))
                .await;
        }
        Err(FieldsError::InvalidShape(detail)) => {
            return exchange
                .reject(session, &state.metrics, &ApiError::InvalidBody(detail))
                .await;
        }
        Ok(fields) => {
            exchange.stream = fields.stream.unwrap_or(false);
            let Some(model) = fields.model else {
                return exchange
                    .reject(session, &state.metrics, &ApiError::MissingModel)
                    .await;
            };
            match state.registry.get(model.as_str()) {
                // An alias is a gateway name: engines know the model by its
                // canonical name, so only then is the body rewritten.
                Some(pool) if pool.name() != model.as_str() => {
                    let renamed = with_model_name(&body, &model, pool.name());
                    (Arc::clone(pool), Some(renamed))
                }
                Some(pool) => (Arc::clone(pool), None),
                None => {
                    let error = ApiError::ModelNotFound {
                        model: model.as_str().to_string(),
                        known: state.registry.known().to_string(),
                    };
                    return exchange.reject(session, &state.metrics, &error).await;
                }
            }
        }
    };
    exchange.pool = Some(Arc::clone(&pool));
    let mut body = renamed.unwrap_or(body);
    let picker = match pool.balancer() {
        Balancer::Policy(policy) => Picker::Policy(policy.as_ref()),
        Balancer::Kv(router) => {
            let route = exchange.route.unwrap_or(Route::ChatCompletions);
            let prepared = match offload::prepare(
                state.preprocess.as_ref(),
                router.preparer(),
                route,
                &body,
                true,
            )
            .await
            {
                Ok(prepared) => prepared,
                Err(InvalidPrompt(message)) => {
                    let error = ApiError::InvalidPrompt(message);
                    return exchange.reject(session, &state.metrics, &error).await;
                }
            };
            let request = router.request(&prepared, std::time::Instant::now());
            if let Some(rewritten) = prepared.rewritten {
                body = rewritten;
            }
            Picker::Kv {
                router: router.as_ref(),
                request,
            }
        }
    };
    forward(state, session, &pool, body, picker, exchange).await
}

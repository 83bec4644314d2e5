//! The data listener's application: OpenAI routes, admission checks, then
//! forwarding. Pingora drives it once per request (HTTP/1.1 keep-alive and
//! h2c streams alike).

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::apps::{
    HttpPersistentSettings, HttpServerApp, HttpServerOptions, ReusedHttpStream,
};
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;

use crate::api_error::{ApiError, ClientErrorReason};
use crate::auth::{ApiKey, AuthFailure, KeyPermit, KeyRejection, prompt_tokens};
use crate::downstream::{Downstream, HttpDownstream};
use crate::exchange::Exchange;
use crate::forward::{Picker, forward};
use crate::headers::{X_REQUEST_ID, content_length, expects_continue};
use crate::kv_route::prepare::{InvalidPrompt, RouteInput};
use crate::limits::{HeadRead, answer_unread_head, check_head, malformed_head_error, read_head};
use crate::openapi;
use crate::request_body::{BodyError, read_body};
use crate::request_fields::{FieldsError, extract, with_model_name};
use crate::respond::{JSON, respond};
use crate::route::{Route, RouteMatch, match_route};
use crate::state::State;

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
        let mut exchange = Exchange::new(request_id);
        let reusable = handle(&state, &mut session, &mut exchange).await;
        let header = session.req_header();
        exchange.finish(&state.registry, &header.method, header.uri.path());
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
async fn handle(state: &State, session: &mut ServerSession, exchange: &mut Exchange) -> bool {
    let header = session.req_header();
    if let Err(error) = check_head(header, &state.limits) {
        session.set_keepalive(None);
        return exchange.reject(session, &state.metrics, &error).await;
    }
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
                return exchange.reject(session, &state.metrics, &error).await;
            }
        }
    };
    if !route.is_proxied() {
        let (content_type, body) = match route {
            Route::OpenApi => (JSON, openapi::spec()),
            Route::Docs => (openapi::HTML, openapi::docs_page()),
            _ => (JSON, state.registry.models_body()),
        };
        exchange.status = 200;
        let extra = [(X_REQUEST_ID, exchange.request_id.clone())];
        return respond(session, 200, content_type, &extra, body).await;
    }
    proxy(state, session, exchange, key).await
}

/// Admission (size, JSON, model, the key's limits, the model's concurrency) and
/// forwarding of a proxied route.
async fn proxy(
    state: &State,
    session: &mut ServerSession,
    exchange: &mut Exchange,
    key: Option<Arc<ApiKey>>,
) -> bool {
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
    let mut client = HttpDownstream::new(session);
    admit_and_forward(state, &mut client, exchange, key, body).await
}

/// Admission of a read request body (JSON, model, the key's limits, the model's
/// concurrency), then forwarding; returns whether the client connection can be reused.
pub(crate) async fn admit_and_forward<D: Downstream>(
    state: &State,
    client: &mut D,
    exchange: &mut Exchange,
    key: Option<Arc<ApiKey>>,
    body: Bytes,
) -> bool {
    let (pool, renamed) = match extract(&body) {
        Err(FieldsError::InvalidJson(detail)) => {
            return client
                .reject(exchange, &state.metrics, &ApiError::InvalidJson(detail))
                .await;
        }
        Err(FieldsError::InvalidShape(detail)) => {
            return client
                .reject(exchange, &state.metrics, &ApiError::InvalidBody(detail))
                .await;
        }
        Ok(fields) => {
            exchange.stream = fields.stream.unwrap_or(false);
            let Some(model) = fields.model else {
                return client
                    .reject(exchange, &state.metrics, &ApiError::MissingModel)
                    .await;
            };
            match state.registry.get(model.as_str()) {
                // An alias is a gateway name: engines know the model by its
                // canonical name, so only then is the body rewritten.
                Some(pool) if pool.name() != model.as_str() => {
                    let renamed = with_model_name(&body, &model, pool.name());
                    (pool, Some(renamed))
                }
                Some(pool) => (pool, None),
                None => {
                    let error = ApiError::ModelNotFound {
                        model: model.as_str().to_string(),
                        known: state.registry.known(),
                    };
                    return client.reject(exchange, &state.metrics, &error).await;
                }
            }
        }
    };
    exchange.pool = Some(Arc::clone(&pool));
    let permit = match key.map(|key| key.admit(pool.name(), Instant::now())) {
        None => None,
        Some(Ok(permit)) => Some(permit),
        Some(Err(rejection)) => {
            let error = key_rejection(state, rejection, pool.name().to_string());
            return client.reject(exchange, &state.metrics, &error).await;
        }
    };
    let _slot = match state.concurrency.get(pool.name()) {
        None => None,
        Some(slots) => {
            let acquired = tokio::select! {
                biased;
                acquired = slots.acquire() => acquired,
                () = client.gone() => {
                    exchange.client_gone = true;
                    return false;
                }
            };
            match acquired {
                Ok(slot) => Some(slot),
                Err(rejection) => {
                    let error = ApiError::ConcurrencyLimited {
                        model: pool.name().to_string(),
                        reason: rejection.describe(),
                        retry_after_secs: slots.retry_after_secs(),
                    };
                    return client.reject(exchange, &state.metrics, &error).await;
                }
            }
        }
    };
    let mut body = renamed.unwrap_or(body);
    let route = exchange.route.unwrap_or(Route::ChatCompletions);
    let picker = match Picker::for_request(state, &pool, route, &mut body).await {
        Ok(picker) => picker,
        Err(InvalidPrompt(message)) => {
            let error = ApiError::InvalidPrompt(message);
            return client.reject(exchange, &state.metrics, &error).await;
        }
    };
    if let Some(permit) = permit.as_ref() {
        charge_prompt(permit, &picker, body.len(), exchange);
    }
    forward(state, client, &pool, body, picker, exchange).await
}

/// The error for a key refused by its own settings (403 or 429); `model` is the requested name.
pub(crate) fn key_rejection(state: &State, rejection: KeyRejection, model: String) -> ApiError {
    match rejection {
        KeyRejection::ModelNotAllowed => {
            state.auth.count_model_not_allowed();
            ApiError::ModelNotAllowed { model }
        }
        KeyRejection::Limited(limit, wait) => ApiError::RateLimited {
            limit: limit.label(),
            retry_after_secs: wait.as_secs_f64().ceil().max(1.0) as u64,
        },
    }
}

/// Charges the prompt's tokens to the key, and meters the completion when the
/// key has a tokens-per-minute limit.
pub(crate) fn charge_prompt(
    permit: &KeyPermit,
    picker: &Picker<'_>,
    body_len: usize,
    exchange: &mut Exchange,
) {
    if !permit.key().meters_tokens() {
        return;
    }
    let tokenized = match picker {
        Picker::Kv { request, .. } => match &request.input {
            RouteInput::Tokens(blocks) => Some(blocks.tokens as u64),
            RouteInput::Fallback(_) => None,
        },
        Picker::Policy(_) => None,
    };
    permit.charge_prompt(prompt_tokens(tokenized, body_len));
    exchange.meter = Some(permit.completion_meter());
}

//! The admin listener: `GET /metrics`, `GET /health`, `GET /live`, and
//! `POST /debug/route` (how `policy: kv` would route a request; see [`crate::kv_route`]) and
//! `POST /reload` (re-read the config file; see [`crate::reload`]).

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use http::{HeaderValue, Method, header};
use pingora_core::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::timeout;

use kvmesh_h1::strict::Violation;
use kvmesh_route::kv::Explanation;
use kvmesh_route::prepare::InvalidPrompt;

use crate::api_error::{ApiError, error_json};
use crate::clock::now_millis;
use crate::headers::content_length;
use crate::reload::{Reloader, Trigger};
use crate::request::admit::{instances_for, resolve_model};
use crate::request::prepare::prepare_prompt;
use crate::request_body::{BodyError, read_body};
use crate::respond::{JSON, respond};
use crate::route::Route;
use crate::state::State;

/// Prometheus text exposition format.
const PROMETHEUS_TEXT: HeaderValue = HeaderValue::from_static("text/plain; version=0.0.4");

/// Serves the admin endpoints.
#[derive(Debug)]
pub(crate) struct AdminApp {
    /// The current state (replaced by reloads).
    state: Arc<ArcSwap<State>>,
    /// True once the data listeners drain (health turns 503).
    draining: watch::Receiver<bool>,
    /// Applies `POST /reload`.
    reloader: Arc<Reloader>,
}

impl AdminApp {
    /// The app; `draining` follows the data listeners' shutdown.
    pub(crate) fn new(
        state: Arc<ArcSwap<State>>,
        draining: watch::Receiver<bool>,
        reloader: Arc<Reloader>,
    ) -> Self {
        Self {
            state,
            draining,
            reloader,
        }
    }

    fn metrics(&self) -> (u16, HeaderValue, Bytes) {
        let state = self.state.load();
        for pool in state.registry.pools() {
            pool.refresh_gauges();
        }
        match state.metrics.render() {
            Ok(text) => (200, PROMETHEUS_TEXT, Bytes::from(text)),
            Err(error) => (
                500,
                JSON,
                Bytes::from(error_json(
                    &error.to_string(),
                    "internal_error",
                    None,
                    "metrics_unavailable",
                )),
            ),
        }
    }

    fn health(&self) -> (u16, HeaderValue, Bytes) {
        let now = now_millis();
        let state = self.state.load();
        let models: Vec<ModelHealth> = state
            .registry
            .pools()
            .iter()
            .map(|pool| {
                let current = pool.instances();
                let instances: Vec<InstanceHealth> = current
                    .iter()
                    .map(|instance| InstanceHealth {
                        url: instance.url().to_string(),
                        state: instance.membership().label(),
                        healthy: instance.is_healthy(),
                        ejected: instance.is_ejected(now),
                        in_flight: instance.in_flight(),
                    })
                    .collect();
                ModelHealth {
                    name: pool.name().to_string(),
                    available: current.iter().filter(|i| i.is_available(now)).count(),
                    instances,
                }
            })
            .collect();
        let draining = *self.draining.borrow();
        let all_served = models.iter().all(|model| model.available > 0);
        let status = if draining {
            "draining"
        } else if all_served {
            "ok"
        } else {
            "unavailable"
        };
        let code = if status == "ok" { 200 } else { 503 };
        let body = serde_json::to_vec(&Health { status, models }).unwrap_or_default();
        (code, JSON, Bytes::from(body))
    }
}

/// `POST /debug/route?route=chat_completions|completions`: reads a request body and explains
/// how its model's `policy: kv` would route it now, without forwarding it, booking load or
/// recording a prediction. (Looking up the index drops predictions whose TTL already passed,
/// which no routing decision would have matched anyway.)
async fn debug_route(state: &State, session: &mut ServerSession) -> (u16, HeaderValue, Bytes) {
    let route = match route_param(session.req_header().uri.query()) {
        Ok(route) => route,
        Err(message) => return invalid(&message, "invalid_route"),
    };
    let limit = state.limits.max_body_bytes;
    let declared = content_length(session.req_header());
    let deadline = tokio::time::Instant::now() + state.limits.client_header_timeout;
    let body = match read_body(session, limit, declared, deadline).await {
        Ok(body) => body,
        Err(BodyError::TooLarge) => return api_error(&ApiError::BodyTooLarge { limit }),
        Err(BodyError::Timeout) => return api_error(&ApiError::RequestTimeout),
        Err(BodyError::Malformed) => return api_error(&ApiError::InvalidFraming(Violation::Chunk)),
        Err(BodyError::Client(error)) => return invalid(&error.to_string(), "invalid_body"),
    };
    let (pool, adapter, body) = match resolve_model(state, body) {
        Ok(resolved) => (resolved.pool, resolved.adapter, resolved.body),
        Err(error) => return api_error(&error),
    };
    let instances = match instances_for(&pool, adapter.as_ref()) {
        Ok(instances) => instances,
        Err(error) => return api_error(&error),
    };
    let Some(router) = pool.balancer().kv_router() else {
        let message = format!("model {:?} does not use policy kv", pool.name());
        return invalid(&message, "not_kv_routed");
    };
    let preparer = match &adapter {
        Some(adapter) => router.preparer().for_adapter(Arc::clone(adapter)),
        None => router.preparer().clone(),
    };
    let prepared = match prepare_prompt(state, &preparer, route, &body, false).await {
        Ok(prepared) => prepared,
        Err(InvalidPrompt(message)) => return api_error(&ApiError::InvalidPrompt(message)),
    };
    let session_key = router
        .session_header()
        .and_then(|name| session.req_header().headers.get(name))
        .and_then(|value| value.to_str().ok());
    let request = router
        .lookup(&prepared, std::time::Instant::now())
        .in_session(session_key);
    let explanation = router.explain(&instances, &request, now_millis(), &mut rand::thread_rng());
    let body = Explained {
        model: pool.name(),
        adapter: adapter.as_deref(),
        route: route.label(),
        explanation,
    };
    match serde_json::to_vec(&body) {
        Ok(json) => (200, JSON, Bytes::from(json)),
        Err(error) => (
            500,
            JSON,
            Bytes::from(error_json(
                &error.to_string(),
                "internal_error",
                None,
                "internal_error",
            )),
        ),
    }
}

/// The `route` query parameter: `chat_completions` (default) or `completions`.
fn route_param(query: Option<&str>) -> Result<Route, String> {
    let value = query
        .unwrap_or("")
        .split('&')
        .filter_map(|pair| pair.split_once('=').or(Some((pair, ""))))
        .find(|(key, _)| *key == "route")
        .map(|(_, value)| value);
    match value {
        None | Some("chat_completions") => Ok(Route::ChatCompletions),
        Some("completions") => Ok(Route::Completions),
        Some(other) => Err(format!(
            "unknown route {other:?}: use chat_completions or completions"
        )),
    }
}

fn api_error(error: &ApiError) -> (u16, HeaderValue, Bytes) {
    (error.status(), JSON, error.body())
}

fn invalid(message: &str, code: &str) -> (u16, HeaderValue, Bytes) {
    let body = error_json(message, "invalid_request_error", None, code);
    (400, JSON, Bytes::from(body))
}

#[derive(Serialize)]
struct Explained<'a> {
    model: &'a str,
    /// The LoRA adapter the request named.
    #[serde(skip_serializing_if = "Option::is_none")]
    adapter: Option<&'a str>,
    route: &'static str,
    #[serde(flatten)]
    explanation: Explanation,
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
    models: Vec<ModelHealth>,
}

#[derive(Serialize)]
struct ModelHealth {
    name: String,
    available: usize,
    instances: Vec<InstanceHealth>,
}

#[derive(Serialize)]
struct InstanceHealth {
    url: String,
    /// Discovery state: ready, not_ready, draining.
    state: &'static str,
    healthy: bool,
    ejected: bool,
    in_flight: u64,
}

#[async_trait]
impl HttpServerApp for AdminApp {
    async fn process_new_http(
        self: &Arc<Self>,
        mut session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        let state = self.state.load_full();
        let limit = state.limits.client_header_timeout;
        if !matches!(timeout(limit, session.read_request()).await, Ok(Ok(true))) {
            return None;
        }
        if *shutdown.borrow() {
            session.set_keepalive(None);
        }
        let header = session.req_header();
        let (get, post) = (header.method == Method::GET, header.method == Method::POST);
        let path = header.uri.path().to_string();
        let (status, content_type, body) = match (get, post, path.as_str()) {
            (true, _, "/metrics") => self.metrics(),
            (true, _, "/health") => self.health(),
            (true, _, "/live") => (200, JSON, Bytes::from_static(b"{\"status\":\"live\"}")),
            (_, true, "/debug/route") => debug_route(&state, &mut session).await,
            (_, true, "/reload") => reload(&self.reloader).await,
            (_, _, "/metrics" | "/health" | "/live" | "/debug/route" | "/reload") => {
                let allow = if path == "/debug/route" || path == "/reload" {
                    "POST"
                } else {
                    "GET"
                };
                let message = format!("method not allowed; use {allow}");
                let body = error_json(
                    &message,
                    "invalid_request_error",
                    None,
                    "method_not_allowed",
                );
                let extra = [(header::ALLOW, HeaderValue::from_static(allow))];
                if !respond(&mut session, 405, JSON, &extra, Bytes::from(body)).await {
                    return None;
                }
                return finish(session).await;
            }
            (_, _, path) => {
                let message = format!("unknown path {path:?}");
                let body = error_json(&message, "not_found_error", None, "unknown_url");
                (404, JSON, Bytes::from(body))
            }
        };
        if !respond(&mut session, status, content_type, &[], body).await {
            return None;
        }
        finish(session).await
    }
}

/// `POST /reload`: re-reads the config file and applies it; 200
/// `{"status":"reloaded"}`, or 400 with the reason (the previous config keeps serving).
async fn reload(reloader: &Reloader) -> (u16, HeaderValue, Bytes) {
    match reloader.reload(Trigger::Admin).await {
        Ok(_) => (200, JSON, Bytes::from_static(b"{\"status\":\"reloaded\"}")),
        Err(error) => {
            let body = error_json(
                &error.to_string(),
                "invalid_request_error",
                None,
                "config_rejected",
            );
            (400, JSON, Bytes::from(body))
        }
    }
}

/// Hands a finished keep-alive connection back to pingora.
async fn finish(session: ServerSession) -> Option<ReusedHttpStream> {
    let settings = HttpPersistentSettings::for_session(&session);
    match session.finish().await {
        Ok(Some(stream)) => Some(ReusedHttpStream::from_reusable_stream(stream, settings)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_parameter_defaults_to_chat() {
        assert_eq!(route_param(None), Ok(Route::ChatCompletions));
        assert_eq!(route_param(Some("")), Ok(Route::ChatCompletions));
        assert_eq!(
            route_param(Some("x=1&route=completions")),
            Ok(Route::Completions)
        );
        assert_eq!(
            route_param(Some("route=chat_completions")),
            Ok(Route::ChatCompletions)
        );
        assert!(route_param(Some("route=embeddings")).is_err());
        assert!(route_param(Some("route")).is_err());
    }
}

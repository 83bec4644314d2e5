//! The admin listener: `GET /metrics`, `GET /health`, `GET /live`.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use http::{HeaderValue, Method, header};
use pingora_core::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::timeout;

use crate::api_error::error_json;
use crate::clock::now_millis;
use crate::respond::{JSON, respond};
use crate::state::State;

/// Prometheus text exposition format.
const PROMETHEUS_TEXT: HeaderValue = HeaderValue::from_static("text/plain; version=0.0.4");

/// Serves the admin endpoints.
#[derive(Debug)]
pub(crate) struct AdminApp {
    state: Arc<State>,
    /// True once the data listeners drain (health turns 503).
    draining: watch::Receiver<bool>,
}

impl AdminApp {
    /// The app; `draining` follows the data listeners' shutdown.
    pub(crate) fn new(state: Arc<State>, draining: watch::Receiver<bool>) -> Self {
        Self { state, draining }
    }

    fn metrics(&self) -> (u16, HeaderValue, Bytes) {
        let now = now_millis();
        for pool in self.state.registry.pools() {
            for instance in pool.instances() {
                instance.refresh_gauges(now);
            }
        }
        match self.state.metrics.render() {
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
        let models: Vec<ModelHealth<'_>> = self
            .state
            .registry
            .pools()
            .iter()
            .map(|pool| {
                let instances: Vec<InstanceHealth<'_>> = pool
                    .instances()
                    .iter()
                    .map(|instance| InstanceHealth {
                        url: instance.url().as_str(),
                        healthy: instance.is_healthy(),
                        ejected: instance.is_ejected(now),
                        in_flight: instance.in_flight(),
                    })
                    .collect();
                ModelHealth {
                    name: pool.name(),
                    available: pool
                        .instances()
                        .iter()
                        .filter(|i| i.is_available(now))
                        .count(),
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

#[derive(Serialize)]
struct Health<'a> {
    status: &'static str,
    models: Vec<ModelHealth<'a>>,
}

#[derive(Serialize)]
struct ModelHealth<'a> {
    name: &'a str,
    available: usize,
    instances: Vec<InstanceHealth<'a>>,
}

#[derive(Serialize)]
struct InstanceHealth<'a> {
    url: &'a str,
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
        let limit = self.state.limits.client_header_timeout;
        if !matches!(timeout(limit, session.read_request()).await, Ok(Ok(true))) {
            return None;
        }
        if *shutdown.borrow() {
            session.set_keepalive(None);
        }
        let header = session.req_header();
        let (status, content_type, body) = match (header.method == Method::GET, header.uri.path()) {
            (true, "/metrics") => self.metrics(),
            (true, "/health") => self.health(),
            (true, "/live") => (200, JSON, Bytes::from_static(b"{\"status\":\"live\"}")),
            (false, "/metrics" | "/health" | "/live") => {
                let body = error_json(
                    "method not allowed; use GET",
                    "invalid_request_error",
                    None,
                    "method_not_allowed",
                );
                let extra = [(header::ALLOW, HeaderValue::from_static("GET"))];
                if !respond(&mut session, 405, JSON, &extra, Bytes::from(body)).await {
                    return None;
                }
                return finish(session).await;
            }
            (_, path) => {
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

/// Hands a finished keep-alive connection back to pingora.
async fn finish(session: ServerSession) -> Option<ReusedHttpStream> {
    let settings = HttpPersistentSettings::for_session(&session);
    match session.finish().await {
        Ok(Some(stream)) => Some(ReusedHttpStream::from_reusable_stream(stream, settings)),
        _ => None,
    }
}

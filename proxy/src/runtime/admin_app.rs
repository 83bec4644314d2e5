//! The admin listener: `GET /metrics`, `GET /health`, `GET /live`, and
//! `POST /debug/route` (how `policy: kv` would route a request; see [`crate::kv_route`]) and
//! `POST /reload` (re-read the config file; see [`crate::runtime::reload`]).

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
use kvmesh_route::kv::{Explanation, TokenizerMismatch, TokenizerOutcome};
use kvmesh_route::prepare::InvalidPrompt;

use crate::engines::clock::now_millis;
use crate::engines::pool::ModelPool;
use crate::frontend::request_body::{BodyError, read_body};
use crate::frontend::respond::{JSON, respond};
use crate::openai::api_error::{ApiError, error_json};
use crate::openai::headers::content_length;
use crate::openai::route::Route;
use crate::request::admit::{instances_for, resolve_model};
use crate::request::prepare::prepare_prompt;
use crate::runtime::reload::{Reloader, Trigger};
use crate::state::shared::State;

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
        let state = self.state.load();
        let draining = *self.draining.borrow();
        let (code, body) = health(&state.registry.pools(), draining, now_millis());
        (code, JSON, Bytes::from(body))
    }
}

/// The `GET /health` status and body for `pools`: 200 `ok` while every model has an available
/// instance; 200 `degraded` when, besides, an instance's engine runs another KV block size
/// than its model, tokenizes otherwise than the proxy, or its agent lost KV events its engine
/// could not replay (scored by predictions alone), or it only prefills for a model that is not disaggregated (it takes
/// no requests); `degraded` names each; 503 `unavailable`
/// when some model has none, `draining` during shutdown.
fn health(pools: &[Arc<ModelPool>], draining: bool, now: u64) -> (u16, Vec<u8>) {
    let mut degraded = Vec::new();
    let models: Vec<ModelHealth> = pools
        .iter()
        .map(|pool| {
            let current = pool.instances();
            let router = pool.balancer().kv_router();
            let instances: Vec<InstanceHealth> = current
                .iter()
                .map(|instance| {
                    let block_size_mismatch = router.and_then(|router| {
                        let engine = router.block_size_conflict(instance.id())?;
                        Some(BlockSizeMismatch {
                            engine_block_size: engine,
                            kv_block_size: router.block_size(),
                        })
                    });
                    if let Some(mismatch) = &block_size_mismatch {
                        degraded.push(format!(
                            "model {:?}: instance {} runs KV blocks of {} tokens, not the model's \
                             {}: scored by predictions alone, not by its KV events",
                            pool.name(),
                            instance.url(),
                            mismatch.engine_block_size,
                            mismatch.kv_block_size
                        ));
                    }
                    let tokenizer_check =
                        router.and_then(|router| router.tokenizer_checks().outcome(instance.id()));
                    let tokenizer_mismatch = match &tokenizer_check {
                        Some(TokenizerOutcome::Mismatched(mismatch)) => Some(mismatch.clone()),
                        _ => None,
                    };
                    if let Some(mismatch) = &tokenizer_mismatch {
                        degraded.push(format!(
                            "model {:?}: instance {}'s engine tokenizes the {} probe otherwise \
                             than the proxy's tokenizer and chat template (from token {}): \
                             scored by predictions alone, not by its KV events",
                            pool.name(),
                            instance.url(),
                            mismatch.probe,
                            mismatch.position
                        ));
                    }
                    let events_incomplete =
                        router.is_some_and(|router| router.events_incomplete(instance.id()));
                    if events_incomplete {
                        degraded.push(format!(
                            "model {:?}: instance {}'s agent lost KV events its engine could \
                             not replay: scored by predictions alone until the engine clears \
                             its cache or restarts",
                            pool.name(),
                            instance.url()
                        ));
                    }
                    let prefill_only_unused =
                        instance.is_unused_prefill_only(pool.disaggregation().is_some());
                    if prefill_only_unused {
                        degraded.push(format!(
                            "model {:?}: instance {} is registered prefill only but the model \
                             has no disaggregation entry: it takes no requests",
                            pool.name(),
                            instance.url()
                        ));
                    }
                    InstanceHealth {
                        url: instance.url().to_string(),
                        state: instance.membership().label(),
                        healthy: instance.is_healthy(),
                        ejected: instance.is_ejected(now),
                        in_flight: instance.in_flight(),
                        block_size_mismatch,
                        tokenizer_check: tokenizer_check.as_ref().map(TokenizerOutcome::label),
                        tokenizer_mismatch,
                        events_incomplete,
                        prefill_only_unused,
                    }
                })
                .collect();
            ModelHealth {
                name: pool.name().to_string(),
                available: current
                    .iter()
                    .filter(|i| {
                        i.is_available(now)
                            && !i.is_unused_prefill_only(pool.disaggregation().is_some())
                    })
                    .count(),
                kv_block_size: router.map(|router| router.block_size()),
                instances,
            }
        })
        .collect();
    let all_served = models.iter().all(|model| model.available > 0);
    let status = if draining {
        "draining"
    } else if !all_served {
        "unavailable"
    } else if degraded.is_empty() {
        "ok"
    } else {
        "degraded"
    };
    let code = if matches!(status, "ok" | "degraded") {
        200
    } else {
        503
    };
    let health = Health {
        status,
        degraded,
        models,
    };
    (code, serde_json::to_vec(&health).unwrap_or_default())
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
    /// `ok`, `degraded` (served, with a problem `degraded` names), `unavailable`, `draining`.
    status: &'static str,
    /// What makes the status `degraded`, one line each (absent when nothing does).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    degraded: Vec<String>,
    models: Vec<ModelHealth>,
}

#[derive(Serialize)]
struct ModelHealth {
    name: String,
    available: usize,
    /// `policy: kv`: tokens per KV block now (`kv.block_size`, else the first instance
    /// record's, else 16).
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_block_size: Option<u64>,
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
    /// Its engine runs another KV block size than its model (absent when they agree).
    #[serde(skip_serializing_if = "Option::is_none")]
    block_size_mismatch: Option<BlockSizeMismatch>,
    /// How its engine's `/tokenize` compared with the proxy's tokenizer: `agreed`,
    /// `mismatched`, `unchecked` (absent: not compared, or not yet).
    #[serde(skip_serializing_if = "Option::is_none")]
    tokenizer_check: Option<&'static str>,
    /// Where its engine tokenized a probe otherwise (absent unless mismatched).
    #[serde(skip_serializing_if = "Option::is_none")]
    tokenizer_mismatch: Option<TokenizerMismatch>,
    /// Its agent lost KV events the engine could not replay (absent when it did not).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    events_incomplete: bool,
    /// It only prefills and its model is not disaggregated: it takes no requests (absent
    /// otherwise).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    prefill_only_unused: bool,
}

#[derive(Serialize)]
struct BlockSizeMismatch {
    /// The engine's, from its instance record.
    engine_block_size: u64,
    /// The model's.
    kv_block_size: u64,
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

    #[test]
    fn an_engine_that_tokenizes_otherwise_degrades_health_without_failing_readiness() {
        let yaml = "models:\n  - name: m\n    policy: kv\n    backends:\n      \
                    - url: http://127.0.0.1:9\n      - url: http://127.0.0.1:10\n";
        let config = kvmesh_config::Config::from_yaml_str(yaml, "test.yaml").expect("config");
        let metrics = crate::metrics::families::Metrics::new().expect("metrics");
        let (state, _) =
            crate::runtime::server::build_state(&config, &metrics, None).expect("state");
        let pools = state.registry.pools();
        let router = pools[0].balancer().kv_router().expect("policy kv");
        router.record_tokenizer_check(0, TokenizerOutcome::Agreed);
        router.record_tokenizer_check(
            1,
            TokenizerOutcome::Mismatched(TokenizerMismatch {
                probe: "chat",
                position: 5,
                proxy_token: Some(198),
                engine_token: Some(271),
                proxy_tokens: 40,
                engine_tokens: 39,
            }),
        );
        let (code, body) = health(&pools, false, 0);
        let body: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(
            (code, body["status"].as_str()),
            (200, Some("degraded")),
            "{body}"
        );
        let reasons = body["degraded"].as_array().expect("reasons");
        assert_eq!(reasons.len(), 1, "{body}");
        let reason = reasons[0].as_str().unwrap_or_default();
        assert!(
            reason.contains("http://127.0.0.1:10") && reason.contains("chat probe"),
            "{reason}"
        );
        let instances = &body["models"][0]["instances"];
        assert_eq!(instances[0]["tokenizer_check"], "agreed", "{body}");
        assert!(instances[0].get("tokenizer_mismatch").is_none(), "{body}");
        assert_eq!(instances[1]["tokenizer_check"], "mismatched", "{body}");
        assert_eq!(instances[1]["tokenizer_mismatch"]["position"], 5, "{body}");
        assert_eq!(
            instances[1]["tokenizer_mismatch"]["engine_token"], 271,
            "{body}"
        );
    }

    #[test]
    fn an_engine_of_another_block_size_degrades_health_without_failing_readiness() {
        let yaml = "models:\n  - name: m\n    policy: kv\n    backends:\n      \
                    - url: http://127.0.0.1:9\n      - url: http://127.0.0.1:10\n";
        let config = kvmesh_config::Config::from_yaml_str(yaml, "test.yaml").expect("config");
        let metrics = crate::metrics::families::Metrics::new().expect("metrics");
        let (state, _) =
            crate::runtime::server::build_state(&config, &metrics, None).expect("state");
        let pools = state.registry.pools();
        let json = |(code, body): (u16, Vec<u8>)| {
            let body: serde_json::Value = serde_json::from_slice(&body).expect("json");
            (code, body)
        };
        let (code, body) = json(health(&pools, false, 0));
        assert_eq!((code, body["status"].as_str()), (200, Some("ok")), "{body}");
        assert!(body.get("degraded").is_none(), "{body}");
        assert_eq!(
            body["models"][0]["kv_block_size"], 16,
            "static backends only"
        );
        let router = pools[0].balancer().kv_router().expect("policy kv");
        router.fit_block_size(0, 16);
        router.fit_block_size(1, 32);
        let (code, body) = json(health(&pools, false, 0));
        assert_eq!(
            (code, body["status"].as_str()),
            (200, Some("degraded")),
            "{body}"
        );
        let reasons = body["degraded"].as_array().expect("reasons");
        assert_eq!(reasons.len(), 1, "{body}");
        let reason = reasons[0].as_str().unwrap_or_default();
        assert!(
            reason.contains("http://127.0.0.1:10") && reason.contains("32 tokens"),
            "{reason}"
        );
        let instances = &body["models"][0]["instances"];
        assert!(instances[0].get("block_size_mismatch").is_none(), "{body}");
        assert_eq!(
            instances[1]["block_size_mismatch"],
            serde_json::json!({"engine_block_size": 32, "kv_block_size": 16})
        );
        // Draining and unavailable still win over degraded.
        let (code, body) = json(health(&pools, true, 0));
        assert_eq!((code, body["status"].as_str()), (503, Some("draining")));
        for instance in pools[0].instances().iter() {
            instance.set_membership(crate::engines::instance::Membership::NotReady);
        }
        let (code, body) = json(health(&pools, false, 0));
        assert_eq!((code, body["status"].as_str()), (503, Some("unavailable")));
    }
}

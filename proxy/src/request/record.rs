//! The record of one proxied request (phase 9 of [`crate::request`]): what it resolved to
//! and how it ended, turned into metrics and one log line at the end.

use std::sync::Arc;

use http::{HeaderValue, Method};
use kvmesh_wire::usage::TokenCount;
use tokio::time::Instant;

use crate::edge::auth::CompletionMeter;
use crate::engines::pool::ModelPool;
use crate::engines::registry::ModelRegistry;
use crate::metrics::failure::FailureKind;
use crate::metrics::families::Metrics;
use crate::openai::api_error::ApiError;
use crate::openai::route::Route;

/// Status logged when the client left before a response was written.
const CLIENT_CLOSED: u16 = 499;

/// One request in progress.
#[derive(Debug)]
pub(crate) struct Record {
    /// `x-request-id` (the client's or generated).
    pub(crate) request_id: HeaderValue,
    /// When the request head was read.
    pub(crate) started: Instant,
    /// The matched route.
    pub(crate) route: Option<Route>,
    /// The model's pool, once resolved.
    pub(crate) pool: Option<Arc<ModelPool>>,
    /// Status sent (0 until one is).
    pub(crate) status: u16,
    /// The instance that answered (its `x-kvmesh-instance` value).
    pub(crate) instance: Option<HeaderValue>,
    /// Why `policy: kv` chose that instance (its `x-kvmesh-route` value).
    pub(crate) kv_route: Option<HeaderValue>,
    /// The client asked for a stream (`"stream": true`).
    pub(crate) stream: bool,
    /// The client disconnected before the request finished.
    pub(crate) client_gone: bool,
    /// The engine failed after the response started.
    pub(crate) upstream_failure: Option<FailureKind>,
    /// Times the stream moved to another instance after its engine broke off.
    pub(crate) migrations: u32,
    /// The answer's tokens, counted as it reached the client.
    pub(crate) tokens: TokenCount,
    /// The prompt's tokens as the proxy tokenized it (`policy: kv`), when it did.
    pub(crate) prompt_tokens: Option<u64>,
    /// Charges the response's completion tokens to the API key (a key with a
    /// tokens-per-minute limit).
    pub(crate) meter: Option<CompletionMeter>,
}

impl Record {
    /// A new record of a request starting now.
    pub(crate) fn new(request_id: HeaderValue) -> Self {
        Self {
            request_id,
            started: Instant::now(),
            route: None,
            pool: None,
            status: 0,
            instance: None,
            kv_route: None,
            stream: false,
            client_gone: false,
            upstream_failure: None,
            migrations: 0,
            tokens: TokenCount::default(),
            prompt_tokens: None,
            meter: None,
        }
    }

    /// Records that the proxy answers with `error`: its status, and the client-error
    /// metric when it is the client's fault.
    pub(crate) fn answered_with(&mut self, metrics: &Metrics, error: &ApiError) {
        self.status = error.status();
        if let Some(reason) = error.client_reason() {
            metrics.client_error(reason);
        }
    }

    /// Counts the tokens of a request answered 200 in its model's token metrics.
    pub(crate) fn count_tokens(&self) {
        if let Some(pool) = self.pool.as_deref().filter(|_| self.status == 200) {
            let prompt = self.tokens.prompt_tokens().or(self.prompt_tokens);
            pool.metrics().observe_tokens(
                prompt,
                self.tokens.cached_tokens(),
                self.tokens.completion_tokens(),
            );
        }
    }

    /// Records metrics and writes the request's log line.
    pub(crate) fn finish(&mut self, registry: &ModelRegistry, method: &Method, path: &str) {
        if self.status == 0 {
            self.status = CLIENT_CLOSED;
        }
        let elapsed = self.started.elapsed();
        let routes = self
            .pool
            .as_deref()
            .map_or_else(|| registry.unattributed(), |pool| &pool.metrics().routes);
        routes
            .route(self.route)
            .observe(self.status, elapsed.as_secs_f64());
        self.count_tokens();
        let model = self.pool.as_deref().map_or("", ModelPool::name);
        let instance = self
            .instance
            .as_ref()
            .and_then(|value| value.to_str().ok())
            .unwrap_or("");
        let request_id = self.request_id.to_str().unwrap_or("");
        let upstream_error = self.upstream_failure.map_or("", FailureKind::label);
        tracing::info!(
            %method,
            path,
            model,
            status = self.status,
            instance,
            duration_ms = elapsed.as_secs_f64() * 1e3,
            request_id,
            stream = self.stream,
            client_gone = self.client_gone,
            upstream_error,
            migrations = self.migrations,
            "request"
        );
    }
}

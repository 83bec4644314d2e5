//! Prometheus metrics (prefix `kvmesh_`), with label children resolved once at
//! startup so the request path touches only atomics.

use std::sync::OnceLock;

use kvmesh_route::metrics::{KvFamilies, KvMetrics};
use kvmesh_telemetry::SpanCounters;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::edge::edge_metrics::EdgeMetrics;
use crate::edge::retry::{RETRY_REASONS, RetryReason};
use crate::metrics::epp::EppMetrics;
use crate::metrics::failure::{FAILURE_KINDS, FailureKind};
use crate::metrics::rpc::{RPC_COUNT, Rpc};
use crate::openai::api_error::{CLIENT_ERROR_REASONS, ClientErrorReason};
use crate::openai::route::{ROUTE_COUNT, Route};

/// Request duration buckets (seconds): from a cached answer to a long generation.
const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Time-to-first-token buckets (seconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Inter-token latency buckets (seconds).
/// Token-length buckets (prompts and completions).
const TOKEN_BUCKETS: &[f64] = &[
    16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
];

/// Model label used for requests that name no served model.
pub(crate) const NO_MODEL: &str = "";

/// Label for requests on no known route.
const NO_ROUTE: &str = "unknown";

/// `protocol` label of the OpenAI HTTP listeners.
const HTTP: &str = "http";
/// `protocol` label of the gRPC listener.
const GRPC: &str = "grpc";

/// Error while creating or registering metrics (only possible at startup).
pub(crate) type MetricsError = prometheus::Error;

/// The proxy's metric families.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    registry: Registry,
    requests_total: IntCounterVec,
    requests_in_flight: IntGaugeVec,
    request_duration: HistogramVec,
    time_to_first_token: HistogramVec,
    inter_token_latency: HistogramVec,
    upstream_errors: IntCounterVec,
    retries: IntCounterVec,
    retry_budget_exhausted: IntCounterVec,
    migrations: IntCounterVec,
    migration_failures: IntCounterVec,
    client_write_timeouts: IntCounterVec,
    prefill_legs: IntCounterVec,
    pool_requests: IntCounterVec,
    input_tokens: HistogramVec,
    output_tokens: HistogramVec,
    output_tokens_total: IntCounterVec,
    input_cached_tokens_total: IntCounterVec,
    instance_in_flight: IntGaugeVec,
    instance_healthy: IntGaugeVec,
    instance_prefill_only_unused: IntGaugeVec,
    client_errors: [IntCounter; CLIENT_ERROR_REASONS],
    kv: KvFamilies,
    /// Authentication, limits, TLS and reload families.
    pub(crate) edge: EdgeMetrics,
    /// The endpoint picker's families.
    pub(crate) epp: EppMetrics,
    /// `kvmesh_trace_spans_exported_total` and `kvmesh_trace_spans_dropped_total{reason}`
    /// (0 while tracing is off).
    pub(crate) trace_spans: SpanCounters,
}

impl Metrics {
    /// Creates and registers every family in a fresh registry.
    pub(crate) fn new() -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let requests_total = IntCounterVec::new(
            Opts::new(
                "kvmesh_requests_total",
                "Requests answered, by model, protocol (http, grpc), route (gRPC: the RPC) and \
                 HTTP status (gRPC: the HTTP status of the same outcome).",
            ),
            &["model", "protocol", "route", "status"],
        )?;
        let requests_in_flight = IntGaugeVec::new(
            Opts::new(
                "kvmesh_requests_in_flight",
                "Requests being forwarded, by model.",
            ),
            &["model"],
        )?;
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_request_duration_seconds",
                "Time from the request head to the end of the response.",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["model", "protocol", "route"],
        )?;
        let time_to_first_token = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_time_to_first_token_seconds",
                "Streamed responses: time from the request head to the first body chunk.",
            )
            .buckets(TTFT_BUCKETS.to_vec()),
            &["model"],
        )?;
        let inter_token_latency = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_inter_token_latency_seconds",
                "Streamed responses: gap between consecutive SSE data events.",
            )
            .buckets(ITL_BUCKETS.to_vec()),
            &["model"],
        )?;
        let upstream_errors = IntCounterVec::new(
            Opts::new(
                "kvmesh_upstream_errors_total",
                "Failed upstream attempts, by model, instance and kind.",
            ),
            &["model", "instance", "kind"],
        )?;
        let retries = IntCounterVec::new(
            Opts::new(
                "kvmesh_retries_total",
                "Attempts retried on another instance before any byte reached the client, by \
                 model and reason (status: a retryable engine status; timeout: no response \
                 head within the first-byte timeout; connect: the connection failed).",
            ),
            &["model", "reason"],
        )?;
        let retry_budget_exhausted = IntCounterVec::new(
            Opts::new(
                "kvmesh_retry_budget_exhausted_total",
                "Retries refused because the model's retry budget was spent (the engine's \
                 answer went to the client as it was).",
            ),
            &["model"],
        )?;
        let migrations = IntCounterVec::new(
            Opts::new(
                "kvmesh_migrations_total",
                "Streams continued on another instance after their engine broke off, by model \
                 and what broke (reset, timeout).",
            ),
            &["model", "kind"],
        )?;
        let migration_failures = IntCounterVec::new(
            Opts::new(
                "kvmesh_migration_failures_total",
                "Streams that migrated, or were to, and still ended with an error event: no \
                 instance could take the continuation, or it broke again with no migration left.",
            ),
            &["model"],
        )?;
        let client_write_timeouts = IntCounterVec::new(
            Opts::new(
                "kvmesh_client_write_timeouts_total",
                "Answers cut because their client took longer than limits.write_timeout to accept \
                 a piece (it stopped reading): the connection is closed, the engine's request \
                 cancelled.",
            ),
            &["model"],
        )?;
        let prefill_legs = IntCounterVec::new(
            Opts::new(
                "kvmesh_prefill_legs_total",
                "Requests of disaggregated models by where they prefilled: remote (a prefill \
                 instance, then the decode instance pulled the KV), local (the decode instance \
                 itself: the uncached prompt was short, or the route has none), failed (the \
                 prefill leg failed; served whole, or 503 with on_prefill_failure: fail).",
            ),
            &["model", "outcome"],
        )?;
        let pool_requests = IntCounterVec::new(
            Opts::new(
                "kvmesh_pool_requests_total",
                "Requests of models with pools, by the pool chosen for them (its prompt length \
                 and TTFT target).",
            ),
            &["model", "pool"],
        )?;
        let input_tokens = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_input_tokens",
                "Prompt tokens of answered requests (the engine's usage, else the proxy's own \
                 tokenization), by model.",
            )
            .buckets(TOKEN_BUCKETS.to_vec()),
            &["model"],
        )?;
        let output_tokens = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_output_tokens",
                "Completion tokens of answered requests (the engine's usage, else one per \
                 streamed event), by model.",
            )
            .buckets(TOKEN_BUCKETS.to_vec()),
            &["model"],
        )?;
        let output_tokens_total = IntCounterVec::new(
            Opts::new(
                "kvmesh_output_tokens_total",
                "Completion tokens relayed to clients, by model.",
            ),
            &["model"],
        )?;
        let input_cached_tokens_total = IntCounterVec::new(
            Opts::new(
                "kvmesh_input_cached_tokens_total",
                "Prompt tokens of answered requests that their engine reported as cached \
                 (usage.prompt_tokens_details.cached_tokens), by model.",
            ),
            &["model"],
        )?;
        let instance_in_flight = IntGaugeVec::new(
            Opts::new(
                "kvmesh_instance_in_flight",
                "Requests in flight per instance.",
            ),
            &["model", "instance"],
        )?;
        let instance_healthy = IntGaugeVec::new(
            Opts::new(
                "kvmesh_instance_healthy",
                "1 when the instance is healthy and not ejected, else 0.",
            ),
            &["model", "instance"],
        )?;
        let instance_prefill_only_unused = IntGaugeVec::new(
            Opts::new(
                "kvmesh_instance_prefill_only_unused",
                "1 while the instance is registered prefill only (--role prefill) for a model without a disaggregation entry: it takes no requests.",
            ),
            &["model", "instance"],
        )?;
        let client_errors_vec = IntCounterVec::new(
            Opts::new(
                "kvmesh_client_errors_total",
                "Requests rejected for bad input, by reason.",
            ),
            &["reason"],
        )?;
        let client_errors = ClientErrorReason::ALL
            .map(|reason| client_errors_vec.with_label_values(&[reason.label()]));
        registry.register(Box::new(requests_total.clone()))?;
        registry.register(Box::new(requests_in_flight.clone()))?;
        registry.register(Box::new(request_duration.clone()))?;
        registry.register(Box::new(time_to_first_token.clone()))?;
        registry.register(Box::new(inter_token_latency.clone()))?;
        registry.register(Box::new(upstream_errors.clone()))?;
        registry.register(Box::new(retries.clone()))?;
        registry.register(Box::new(retry_budget_exhausted.clone()))?;
        registry.register(Box::new(migrations.clone()))?;
        registry.register(Box::new(migration_failures.clone()))?;
        registry.register(Box::new(client_write_timeouts.clone()))?;
        registry.register(Box::new(prefill_legs.clone()))?;
        registry.register(Box::new(pool_requests.clone()))?;
        registry.register(Box::new(input_tokens.clone()))?;
        registry.register(Box::new(output_tokens.clone()))?;
        registry.register(Box::new(output_tokens_total.clone()))?;
        registry.register(Box::new(input_cached_tokens_total.clone()))?;
        registry.register(Box::new(instance_in_flight.clone()))?;
        registry.register(Box::new(instance_healthy.clone()))?;
        registry.register(Box::new(instance_prefill_only_unused.clone()))?;
        registry.register(Box::new(client_errors_vec))?;
        let kv = KvFamilies::register(&registry)?;
        let edge = EdgeMetrics::new(&registry)?;
        let epp = EppMetrics::new(&registry)?;
        let trace_spans = SpanCounters::register(&registry, "kvmesh")?;
        Ok(Self {
            registry,
            requests_total,
            requests_in_flight,
            request_duration,
            time_to_first_token,
            inter_token_latency,
            upstream_errors,
            retries,
            retry_budget_exhausted,
            migrations,
            migration_failures,
            client_write_timeouts,
            prefill_legs,
            pool_requests,
            input_tokens,
            output_tokens,
            output_tokens_total,
            input_cached_tokens_total,
            instance_in_flight,
            instance_healthy,
            instance_prefill_only_unused,
            client_errors,
            kv,
            edge,
            epp,
            trace_spans,
        })
    }

    /// Handles of `policy: kv` for `model`.
    pub(crate) fn kv(&self, model: &str) -> KvMetrics {
        self.kv.model(model)
    }

    /// Handles for a served model.
    pub(crate) fn model(&self, model: &str) -> ModelMetrics {
        ModelMetrics {
            in_flight: self.requests_in_flight.with_label_values(&[model]),
            time_to_first_token: self.time_to_first_token.with_label_values(&[model]),
            inter_token_latency: self.inter_token_latency.with_label_values(&[model]),
            retries: RetryReason::ALL
                .map(|reason| self.retries.with_label_values(&[model, reason.label()])),
            retry_budget_exhausted: self.retry_budget_exhausted.with_label_values(&[model]),
            migrations: FailureKind::ALL
                .map(|kind| self.migrations.with_label_values(&[model, kind.label()])),
            migration_failures: self.migration_failures.with_label_values(&[model]),
            client_write_timeouts: self.client_write_timeouts.with_label_values(&[model]),
            prefill_legs: PrefillLeg::ALL
                .map(|leg| self.prefill_legs.with_label_values(&[model, leg.label()])),
            pool_requests: self.pool_requests.clone(),
            model: model.into(),
            input_tokens: self.input_tokens.with_label_values(&[model]),
            output_tokens: self.output_tokens.with_label_values(&[model]),
            output_tokens_total: self.output_tokens_total.with_label_values(&[model]),
            input_cached_tokens: self.input_cached_tokens_total.with_label_values(&[model]),
            routes: self.routes(model),
            rpcs: self.rpcs(model),
        }
    }

    /// Per-route handles for `model` (`NO_MODEL` for requests that resolve to
    /// none); each series appears on first use.
    pub(crate) fn routes(&self, model: &str) -> RouteTable {
        let route = |route| self.route_metrics(model, HTTP, route);
        RouteTable {
            routes: Route::ALL.map(|r| route(r.label())),
            unrouted: route(NO_ROUTE),
        }
    }

    /// Per-RPC handles of the gRPC listener for `model` (`NO_MODEL` for requests that
    /// resolve to none); each series appears on first use.
    pub(crate) fn rpcs(&self, model: &str) -> RpcTable {
        RpcTable {
            rpcs: Rpc::ALL.map(|rpc| self.route_metrics(model, GRPC, rpc.label())),
        }
    }

    fn route_metrics(
        &self,
        model: &str,
        protocol: &'static str,
        route: &'static str,
    ) -> RouteMetrics {
        RouteMetrics {
            model: model.to_string(),
            protocol,
            route,
            requests_total: self.requests_total.clone(),
            request_duration: self.request_duration.clone(),
            ok_total: OnceLock::new(),
            error_totals: Default::default(),
            duration: OnceLock::new(),
        }
    }

    /// Handles for one instance of `model`.
    pub(crate) fn instance(&self, model: &str, instance: &str) -> InstanceMetrics {
        InstanceMetrics {
            errors: FailureKind::ALL.map(|kind| {
                self.upstream_errors
                    .with_label_values(&[model, instance, kind.label()])
            }),
            in_flight: self
                .instance_in_flight
                .with_label_values(&[model, instance]),
            healthy: self.instance_healthy.with_label_values(&[model, instance]),
            prefill_only_unused: self
                .instance_prefill_only_unused
                .with_label_values(&[model, instance]),
        }
    }

    /// Drops the series of an instance that left `model` (so departed instances do not
    /// linger in scrapes).
    pub(crate) fn forget_instance(&self, model: &str, instance: &str) {
        for kind in FailureKind::ALL {
            let _ = self
                .upstream_errors
                .remove_label_values(&[model, instance, kind.label()]);
        }
        let _ = self
            .instance_in_flight
            .remove_label_values(&[model, instance]);
        let _ = self
            .instance_healthy
            .remove_label_values(&[model, instance]);
        let _ = self
            .instance_prefill_only_unused
            .remove_label_values(&[model, instance]);
        self.kv.forget_instance(model, instance);
    }

    /// Counts a rejected bad request.
    pub(crate) fn client_error(&self, reason: ClientErrorReason) {
        if let Some(counter) = self.client_errors.get(reason as usize) {
            counter.inc();
        }
    }

    /// Registers a family defined elsewhere (the control plane's).
    pub(crate) fn register(
        &self,
        collector: Box<dyn prometheus::core::Collector>,
    ) -> Result<(), MetricsError> {
        self.registry.register(collector)
    }

    /// Prometheus text exposition of every family.
    pub(crate) fn render(&self) -> Result<Vec<u8>, MetricsError> {
        let mut out = Vec::with_capacity(16 * 1024);
        TextEncoder::new().encode(&self.registry.gather(), &mut out)?;
        Ok(out)
    }
}

/// Per-model handles.
#[derive(Debug)]
pub(crate) struct ModelMetrics {
    /// `kvmesh_requests_in_flight{model}`.
    pub(crate) in_flight: IntGauge,
    /// `kvmesh_time_to_first_token_seconds{model}`.
    pub(crate) time_to_first_token: Histogram,
    /// `kvmesh_inter_token_latency_seconds{model}`.
    pub(crate) inter_token_latency: Histogram,
    /// `kvmesh_retries_total{model,reason}`, by [`RetryReason::index`].
    pub(crate) retries: [IntCounter; RETRY_REASONS],
    /// `kvmesh_retry_budget_exhausted_total{model}`.
    pub(crate) retry_budget_exhausted: IntCounter,
    /// `kvmesh_migrations_total{model,kind}`, by [`FailureKind`] index.
    pub(crate) migrations: [IntCounter; FAILURE_KINDS],
    /// `kvmesh_migration_failures_total{model}`.
    pub(crate) migration_failures: IntCounter,
    /// `kvmesh_client_write_timeouts_total{model}`.
    pub(crate) client_write_timeouts: IntCounter,
    /// `kvmesh_prefill_legs_total{model,outcome}`, by [`PrefillLeg`].
    prefill_legs: [IntCounter; 3],
    /// `kvmesh_pool_requests_total` (children resolved per request: pools vary by model).
    pool_requests: IntCounterVec,
    /// The model's name, for the children of `pool_requests`.
    model: Box<str>,
    /// `kvmesh_input_tokens{model}`.
    input_tokens: Histogram,
    /// `kvmesh_output_tokens{model}`.
    output_tokens: Histogram,
    /// `kvmesh_output_tokens_total{model}`.
    output_tokens_total: IntCounter,
    /// `kvmesh_input_cached_tokens_total{model}`.
    input_cached_tokens: IntCounter,
    /// Per-route request counts and durations.
    pub(crate) routes: RouteTable,
    /// Per-RPC request counts and durations of the gRPC listener.
    pub(crate) rpcs: RpcTable,
}

/// Where a disaggregated model's request prefilled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PrefillLeg {
    /// On a prefill instance.
    Remote,
    /// On its decode instance.
    Local,
    /// The prefill leg failed.
    Failed,
}

impl PrefillLeg {
    const ALL: [PrefillLeg; 3] = [Self::Remote, Self::Local, Self::Failed];

    fn label(self) -> &'static str {
        match self {
            Self::Remote => "remote",
            Self::Local => "local",
            Self::Failed => "failed",
        }
    }
}

impl ModelMetrics {
    /// Counts a request sent to the model's pool `pool`.
    pub(crate) fn pool_chosen(&self, pool: &str) {
        self.pool_requests
            .with_label_values(&[&self.model, pool])
            .inc();
    }

    /// Counts where a request prefilled.
    pub(crate) fn prefill_leg(&self, leg: PrefillLeg) {
        self.prefill_legs[leg as usize].inc();
    }

    /// Counts an answered request's `prompt` tokens (when known), the `cached` part of them
    /// its engine reported (when it did) and its `completion` tokens.
    pub(crate) fn observe_tokens(&self, prompt: Option<u64>, cached: Option<u64>, completion: u64) {
        if let Some(prompt) = prompt {
            self.input_tokens.observe(prompt as f64);
        }
        if let Some(cached) = cached {
            self.input_cached_tokens.inc_by(cached);
        }
        self.output_tokens.observe(completion as f64);
        self.output_tokens_total.inc_by(completion);
    }
}

/// Per-RPC handles of one model on the gRPC listener.
#[derive(Debug)]
pub(crate) struct RpcTable {
    rpcs: [RouteMetrics; RPC_COUNT],
}

impl RpcTable {
    /// Handles for `rpc`.
    pub(crate) fn rpc(&self, rpc: Rpc) -> &RouteMetrics {
        &self.rpcs[rpc.index()]
    }
}

/// Per-route handles of one model.
#[derive(Debug)]
pub(crate) struct RouteTable {
    routes: [RouteMetrics; ROUTE_COUNT],
    unrouted: RouteMetrics,
}

impl RouteTable {
    /// Handles for `route` (`None`: a request on no known route).
    pub(crate) fn route(&self, route: Option<Route>) -> &RouteMetrics {
        route
            .and_then(|route| self.routes.get(route.index()))
            .unwrap_or(&self.unrouted)
    }
}

/// The error statuses kvmesh answers most (client errors, limits, engine failures), whose
/// request counters are cached like the 200 one.
const COMMON_ERRORS: [u16; 12] = [400, 401, 403, 404, 408, 413, 429, 499, 500, 502, 503, 504];

/// Per-(model, route) handles, resolved on first use and cached.
#[derive(Debug)]
pub(crate) struct RouteMetrics {
    model: String,
    protocol: &'static str,
    route: &'static str,
    requests_total: IntCounterVec,
    request_duration: HistogramVec,
    ok_total: OnceLock<IntCounter>,
    /// `requests_total` of each of [`COMMON_ERRORS`], in that order.
    error_totals: [OnceLock<IntCounter>; COMMON_ERRORS.len()],
    duration: OnceLock<Histogram>,
}

impl RouteMetrics {
    /// Records one answered request.
    pub(crate) fn observe(&self, status: u16, seconds: f64) {
        if status == 200 {
            self.ok_total
                .get_or_init(|| {
                    self.requests_total.with_label_values(&[
                        self.model.as_str(),
                        self.protocol,
                        self.route,
                        "200",
                    ])
                })
                .inc();
        } else if let Some(slot) = COMMON_ERRORS.iter().position(|&code| code == status) {
            self.error_totals[slot]
                .get_or_init(|| self.total_for(status))
                .inc();
        } else {
            self.total_for(status).inc();
        }
        self.duration
            .get_or_init(|| {
                self.request_duration.with_label_values(&[
                    self.model.as_str(),
                    self.protocol,
                    self.route,
                ])
            })
            .observe(seconds);
    }

    /// The `requests_total` counter of `status` (label `other` when it is not a status).
    fn total_for(&self, status: u16) -> IntCounter {
        let code = http::StatusCode::from_u16(status).ok();
        let label = code.as_ref().map_or("other", http::StatusCode::as_str);
        self.requests_total.with_label_values(&[
            self.model.as_str(),
            self.protocol,
            self.route,
            label,
        ])
    }
}

/// Per-instance handles.
#[derive(Debug, Clone)]
pub(crate) struct InstanceMetrics {
    errors: [IntCounter; FAILURE_KINDS],
    in_flight: IntGauge,
    healthy: IntGauge,
    prefill_only_unused: IntGauge,
}

impl InstanceMetrics {
    /// Counts one upstream error.
    pub(crate) fn count_error(&self, kind: FailureKind) {
        if let Some(counter) = self.errors.get(kind.index()) {
            counter.inc();
        }
    }

    /// Sets the state gauges (`unused`: a prefill-only instance of a model that is not
    /// disaggregated, which takes no requests).
    pub(crate) fn set_state(&self, in_flight: i64, healthy: bool, unused: bool) {
        self.in_flight.set(in_flight);
        self.healthy.set(i64::from(healthy));
        self.prefill_only_unused.set(i64::from(unused));
    }
}

/// Keeps a gauge incremented while alive.
pub(crate) struct GaugeGuard<'a>(&'a IntGauge);

impl<'a> GaugeGuard<'a> {
    /// Increments `gauge` until the guard drops.
    pub(crate) fn new(gauge: &'a IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(metrics: &Metrics) -> String {
        String::from_utf8(metrics.render().unwrap()).unwrap()
    }

    #[test]
    fn renders_every_family_with_labels() {
        let metrics = Metrics::new().unwrap();
        let model = metrics.model("qwen3");
        model
            .routes
            .route(Some(Route::ChatCompletions))
            .observe(200, 0.5);
        model
            .routes
            .route(Some(Route::ChatCompletions))
            .observe(503, 0.001);
        model.routes.route(None).observe(404, 0.001);
        model.rpcs.rpc(Rpc::ModelStreamInfer).observe(200, 0.2);
        model.rpcs.rpc(Rpc::ModelInfer).observe(404, 0.001);
        model.in_flight.inc();
        model.time_to_first_token.observe(0.1);
        model.inter_token_latency.observe(0.01);
        model.observe_tokens(Some(70), Some(64), 5);
        model.observe_tokens(Some(30), None, 2);
        model.migration_failures.inc();
        model.client_write_timeouts.inc();
        let instance = metrics.instance("qwen3", "http://127.0.0.1:1");
        instance.count_error(FailureKind::Connect);
        instance.set_state(3, true, false);
        metrics.client_error(ClientErrorReason::MissingModel);
        let out = text(&metrics);
        for line in [
            "kvmesh_requests_total{model=\"qwen3\",protocol=\"http\",route=\"chat_completions\",status=\"200\"} 1",
            "kvmesh_requests_total{model=\"qwen3\",protocol=\"http\",route=\"chat_completions\",status=\"503\"} 1",
            "kvmesh_requests_total{model=\"qwen3\",protocol=\"http\",route=\"unknown\",status=\"404\"} 1",
            "kvmesh_requests_total{model=\"qwen3\",protocol=\"grpc\",route=\"model_stream_infer\",status=\"200\"} 1",
            "kvmesh_requests_total{model=\"qwen3\",protocol=\"grpc\",route=\"model_infer\",status=\"404\"} 1",
            "kvmesh_request_duration_seconds_count{model=\"qwen3\",protocol=\"grpc\",route=\"model_infer\"} 1",
            "kvmesh_requests_in_flight{model=\"qwen3\"} 1",
            "kvmesh_request_duration_seconds_count{model=\"qwen3\",protocol=\"http\",route=\"chat_completions\"} 2",
            "kvmesh_time_to_first_token_seconds_count{model=\"qwen3\"} 1",
            "kvmesh_inter_token_latency_seconds_count{model=\"qwen3\"} 1",
            "kvmesh_input_tokens_sum{model=\"qwen3\"} 100",
            "kvmesh_input_cached_tokens_total{model=\"qwen3\"} 64",
            "kvmesh_output_tokens_total{model=\"qwen3\"} 7",
            "kvmesh_migration_failures_total{model=\"qwen3\"} 1",
            "kvmesh_client_write_timeouts_total{model=\"qwen3\"} 1",
            "kvmesh_upstream_errors_total{instance=\"http://127.0.0.1:1\",kind=\"connect\",model=\"qwen3\"} 1",
            "kvmesh_instance_in_flight{instance=\"http://127.0.0.1:1\",model=\"qwen3\"} 3",
            "kvmesh_instance_healthy{instance=\"http://127.0.0.1:1\",model=\"qwen3\"} 1",
            "kvmesh_client_errors_total{reason=\"missing_model\"} 1",
            "kvmesh_client_errors_total{reason=\"invalid_json\"} 0",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
        assert!(
            !out.contains("route=\"embeddings\""),
            "unused routes stay absent"
        );
    }
}

//! State shared by every connection, built from the config at startup and
//! again on every reload (see [`crate::runtime::reload`]); each request loads the
//! current one once, when its head arrives.

use std::sync::Arc;

use kvmesh_config::LimitsConfig;

use kvmesh_route::prepare::offload::PreprocessPool;

use crate::edge::auth::Authenticator;
use crate::edge::limits::ConcurrencyLimits;
use crate::edge::request_id::RequestIds;
use crate::edge::retry::RetryPolicy;
use crate::engines::outlier::OutlierPolicy;
use crate::engines::registry::ModelRegistry;
use crate::engines::upstream::Upstream;
use crate::metrics::families::Metrics;
use crate::openai::route::EngineRoutes;

/// Everything the request path reads; nothing in it is locked.
#[derive(Debug)]
pub(crate) struct State {
    /// Models by name and alias (shared with the next state when a reload keeps
    /// the models, so their pools, KV indexes and health carry over).
    pub(crate) registry: Arc<ModelRegistry>,
    /// Connections to engines (shared with the next state when a reload keeps the
    /// upstream settings, so pooled connections carry over).
    pub(crate) upstream: Arc<Upstream>,
    /// Metric families.
    pub(crate) metrics: Metrics,
    /// Request id generator.
    pub(crate) request_ids: RequestIds,
    /// Size limit and timeouts.
    pub(crate) limits: LimitsConfig,
    /// The engines' own routes forwarded as they are.
    pub(crate) engine_routes: EngineRoutes,
    /// Which failed answers are retried, with what backoff and budget.
    pub(crate) retry: RetryPolicy,
    /// Ejection parameters.
    pub(crate) outlier: OutlierPolicy,
    /// Health-check interval (for `Retry-After`).
    pub(crate) health_interval_ms: u64,
    /// Threads that tokenize long prompts (`None` when no model uses `policy: kv`).
    /// Shared with the next state across reloads.
    pub(crate) preprocess: Option<Arc<PreprocessPool>>,
    /// API keys and their limits.
    pub(crate) auth: Authenticator,
    /// Per-model concurrency limits.
    pub(crate) concurrency: ConcurrencyLimits,
    /// Where request spans start (`None`: tracing is off). Kept by reloads.
    pub(crate) tracer: Option<kvmesh_telemetry::Tracer>,
}

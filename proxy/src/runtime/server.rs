//! The library entry point: bind the listeners, then serve until shutdown.

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use kvmesh_config::{
    Config, DiscoveryKind, EPP_LISTENER, EventsKind, GRPC_LISTENER, HealthCheckConfig, ModelConfig,
    PolicyKind, TelemetryConfig,
};
use kvmesh_telemetry::{Telemetry, TraceSettings};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use kvmesh_route::prepare::offload::PreprocessPool;

use crate::edge::auth::Authenticator;
use crate::edge::error::ProxyError;
use crate::edge::limits::ConcurrencyLimits;
use crate::edge::request_id::RequestIds;
use crate::edge::retry::RetryPolicy;
use crate::edge::tls::{ListenerTls, TlsSettings, TlsTerminator, upstream_ca_file};
use crate::engines::discovery::{Discovery, StaticDiscovery};
use crate::engines::instance::PeerSettings;
use crate::engines::outlier::OutlierPolicy;
use crate::engines::pool_builder::PoolBuilder;
use crate::engines::registry::{ModelRegistry, NamedPool};
use crate::engines::upstream::{Upstream, UpstreamSettings};
use crate::frontend::accept::{ListenerApps, serve};
use crate::frontend::data_app::DataApp;
use crate::frontend::epp::EppListener;
use crate::frontend::grpc::GrpcListener;
use crate::metrics::families::Metrics;
use crate::openai::route::EngineRoutes;
use crate::runtime::admin_app::AdminApp;
use crate::runtime::control_plane::{ControlLoops, ControlPlane, is_dynamic};
use crate::runtime::reload::{ReloadHandle, Reloader, watch_files};
use crate::state::health_check::{interval_ms, spawn_probes};
use crate::state::kv_sweeper::spawn_sweepers;
use crate::state::shared::State;
use crate::state::tokenizer_check::spawn_checks as spawn_tokenizer_checks;

/// Name the admin listener is announced under.
pub const ADMIN_LISTENER: &str = "admin";

/// Idle upstream connections are pooled for at least this many instances when discovery can
/// add instances at run time (the pool is sized at startup).
const DYNAMIC_INSTANCES_HINT: usize = 64;

/// How long admin connections may linger after the data listeners drained.
const ADMIN_DRAIN: Duration = Duration::from_secs(1);

/// A bound data listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundListener {
    /// The configured name.
    pub name: String,
    /// The actual address (the real port when the config said 0).
    pub address: SocketAddr,
}

/// A proxy whose listeners are bound; [`Proxy::run`] serves them.
#[derive(Debug)]
pub struct Proxy {
    /// The current state; reloads replace it.
    state: Arc<ArcSwap<State>>,
    /// Swaps configs (SIGHUP, file changes, `POST /reload`).
    reloader: Arc<Reloader>,
    /// Each data listener's TLS, in config order.
    tls: Vec<Option<Arc<ListenerTls>>>,
    /// The endpoint picker's own TLS (`epp.tls`).
    epp_tls: Option<Arc<ListenerTls>>,
    /// How often watched files are polled (`None`: not watched).
    watch: Option<Duration>,
    data: Vec<TcpListener>,
    listeners: Vec<BoundListener>,
    admin: TcpListener,
    admin_address: SocketAddr,
    /// The KServe v2 gRPC listener (`grpc.address`).
    grpc: Option<GrpcListener>,
    /// The endpoint picker listener (`epp.address`).
    epp: Option<EppListener>,
    health_check: HealthCheckConfig,
    drain_timeout: Duration,
    control: ControlLoops,
    /// Span export (`telemetry.otlp_endpoint`), flushed when the proxy stops.
    telemetry: Option<Telemetry>,
}

impl Proxy {
    /// Validates `config`, builds the model pools and binds every listener.
    /// Must be called inside a tokio runtime.
    pub async fn bind(config: Config) -> Result<Self, ProxyError> {
        Self::bind_with(config, ControlPlane::default()).await
    }

    /// [`Proxy::bind`] with in-process control-plane backends, for `discovery.kind:
    /// in_process` and `events.kind: in_process` (a program embedding the proxy and its
    /// agents, like the demo). With `discovery.kind: etcd` the registry's records are listed
    /// before this returns (up to `discovery.initial_sync_timeout`).
    pub async fn bind_with(config: Config, control: ControlPlane) -> Result<Self, ProxyError> {
        Self::bind_config(config, None, control).await
    }

    /// [`Proxy::bind`] with `config` as read from the file at `path`: reloads
    /// re-read that file (SIGHUP in `kvmesh-proxy`, `POST /reload`, and with
    /// `reload.watch` a change of the file).
    pub async fn bind_file(config: Config, path: impl Into<PathBuf>) -> Result<Self, ProxyError> {
        Self::bind_config(config, Some(path.into()), ControlPlane::default()).await
    }

    async fn bind_config(
        config: Config,
        path: Option<PathBuf>,
        control: ControlPlane,
    ) -> Result<Self, ProxyError> {
        config.validate()?;
        let metrics = Metrics::new()?;
        let tls = listener_tls(&config, &metrics)?;
        let epp_tls = epp_tls(&config, &metrics)?;
        let telemetry = start_telemetry(&config.telemetry, &metrics)?;
        let (mut state, builder) = build_state(&config, &metrics, None)?;
        state.tracer = telemetry
            .as_ref()
            .map(|telemetry| telemetry.tracer("kvmesh-proxy"));
        let state = Arc::new(state);
        let mut control =
            ControlLoops::prepare(&config, control, builder, &state.metrics, &state).await?;
        let state = Arc::new(ArcSwap::new(state));
        let terminators = tls
            .iter()
            .map(|tls| tls.as_ref().map(|tls| Arc::clone(&tls.terminator)))
            .collect();
        let watch = config.reload.watch.then_some(config.reload.poll_interval);
        let mut data = Vec::with_capacity(config.listeners.len());
        let mut listeners = Vec::with_capacity(config.listeners.len());
        for listener in &config.listeners {
            let socket = bind(&listener.name, listener.address).await?;
            listeners.push(BoundListener {
                name: listener.name.clone(),
                address: local_address(&socket, &listener.name, listener.address)?,
            });
            data.push(socket);
        }
        let admin = bind(ADMIN_LISTENER, config.admin.address).await?;
        let admin_address = local_address(&admin, ADMIN_LISTENER, config.admin.address)?;
        let grpc = GrpcListener::bind(&config.grpc).await?;
        let epp = EppListener::bind(&config.epp).await?;
        let health_check = config.health_check.clone();
        let drain_timeout = config.shutdown.drain_timeout;
        let reloader = Arc::new(Reloader::new(
            path,
            Arc::clone(&state),
            metrics,
            terminators,
            control.reload_notifier(),
            config,
        ));
        Ok(Self {
            state,
            reloader,
            tls,
            epp_tls,
            watch,
            data,
            listeners,
            admin,
            admin_address,
            grpc,
            epp,
            health_check,
            drain_timeout,
            control,
            telemetry,
        })
    }

    /// Reloads this proxy's config while it runs (SIGHUP does the same).
    pub fn reload_handle(&self) -> ReloadHandle {
        ReloadHandle::new(Arc::clone(&self.reloader))
    }

    /// The data listeners, in config order.
    pub fn listeners(&self) -> &[BoundListener] {
        &self.listeners
    }

    /// The admin listener's address.
    pub fn admin_address(&self) -> SocketAddr {
        self.admin_address
    }

    /// The gRPC listener's address, when `grpc.address` is set.
    pub fn grpc_address(&self) -> Option<SocketAddr> {
        self.grpc.as_ref().map(GrpcListener::address)
    }

    /// The endpoint picker's address, when `epp.address` is set.
    pub fn epp_address(&self) -> Option<SocketAddr> {
        self.epp.as_ref().map(EppListener::address)
    }

    /// Writes `LISTENING <name> <addr>` for every data listener, then for
    /// `grpc` and `epp` (when on) and `admin`, and flushes. (`READY` is the caller's to
    /// print.)
    pub fn announce(&self, out: &mut impl Write) -> std::io::Result<()> {
        for listener in &self.listeners {
            writeln!(out, "LISTENING {} {}", listener.name, listener.address)?;
        }
        if let Some(grpc) = &self.grpc {
            writeln!(out, "LISTENING {GRPC_LISTENER} {}", grpc.address())?;
        }
        if let Some(epp) = &self.epp {
            writeln!(out, "LISTENING {EPP_LISTENER} {}", epp.address())?;
        }
        writeln!(out, "LISTENING {ADMIN_LISTENER} {}", self.admin_address)?;
        out.flush()
    }

    /// Serves until `shutdown` completes, then stops accepting, lets in-flight
    /// requests and streams finish (up to `shutdown.drain_timeout`), closes idle
    /// connections and returns.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ProxyError> {
        let (data_tx, data_rx) = watch::channel(false);
        let (admin_tx, admin_rx) = watch::channel(false);
        let initial = self.state.load_full();
        let first_bytes_timeout = initial.limits.client_header_timeout;
        let mut probes = JoinSet::new();
        self.reloader.start_tasks().await;
        let health_check = Arc::new(self.health_check);
        let new_instance_probes = health_check.enabled.then(|| Arc::clone(&health_check));
        let discovery_synced = self.control.discovery_synced();
        self.control
            .start(&self.state, &initial, new_instance_probes, &mut probes);
        drop(initial);
        if let Some(period) = self.watch {
            let tls = self
                .tls
                .iter()
                .flatten()
                .chain(&self.epp_tls)
                .map(Arc::clone);
            let tls = tls.collect();
            probes.spawn(watch_files(Arc::clone(&self.reloader), tls, period));
        }
        // The gRPC listener speaks TLS with the first TLS data listener's certificate.
        let grpc_tls = self.tls.iter().flatten().next().cloned();
        let grpc_loop = self.grpc.map(|grpc| {
            let mut stopping = data_rx.clone();
            let shutdown = async move {
                let _ = stopping.wait_for(|stop| *stop).await;
            };
            tokio::spawn(grpc.serve(
                Arc::clone(&self.state),
                grpc_tls,
                first_bytes_timeout,
                shutdown,
                self.drain_timeout,
            ))
        });
        let epp_loop = self.epp.map(|epp| {
            let mut stopping = data_rx.clone();
            let shutdown = async move {
                let _ = stopping.wait_for(|stop| *stop).await;
            };
            tokio::spawn(
                epp.serve(
                    Arc::clone(&self.state),
                    discovery_synced,
                    self.epp_tls
                        .or_else(|| self.tls.iter().flatten().next().cloned()),
                    first_bytes_timeout,
                    shutdown,
                    self.drain_timeout,
                ),
            )
        });
        let mut data_loops = JoinSet::new();
        for (listener, tls) in self.data.into_iter().zip(self.tls) {
            let apps = ListenerApps {
                h1: Arc::new(DataApp::new(Arc::clone(&self.state), false)),
                h2c: Some(Arc::new(DataApp::new(Arc::clone(&self.state), true))),
                fast: Some(Arc::clone(&self.state)),
                first_bytes_timeout,
                drain_timeout: self.drain_timeout,
                tls,
            };
            data_loops.spawn(serve(listener, apps, data_rx.clone()));
        }
        let admin_apps = ListenerApps {
            h1: Arc::new(AdminApp::new(
                Arc::clone(&self.state),
                data_rx.clone(),
                Arc::clone(&self.reloader),
            )),
            h2c: None,
            fast: None,
            first_bytes_timeout,
            drain_timeout: ADMIN_DRAIN,
            tls: None,
        };
        let admin_loop = tokio::spawn(serve(self.admin, admin_apps, admin_rx));

        shutdown.await;
        tracing::info!(
            drain_timeout_ms = u64::try_from(self.drain_timeout.as_millis()).unwrap_or(u64::MAX),
            "shutting down: draining in-flight requests"
        );
        let _ = data_tx.send(true);
        while data_loops.join_next().await.is_some() {}
        if let Some(grpc_loop) = grpc_loop {
            match grpc_loop.await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "gRPC listener failed"),
                Err(error) => tracing::warn!(%error, "gRPC listener task failed"),
            }
        }
        if let Some(epp_loop) = epp_loop {
            match epp_loop.await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "endpoint picker listener failed"),
                Err(error) => tracing::warn!(%error, "endpoint picker listener task failed"),
            }
        }
        let _ = admin_tx.send(true);
        if let Err(error) = admin_loop.await {
            tracing::warn!(%error, "admin listener task failed");
        }
        probes.abort_all();
        self.reloader.stop().await;
        if let Some(telemetry) = self.telemetry {
            telemetry.shutdown().await;
        }
        tracing::info!("shutdown complete");
        Ok(())
    }
}

/// Binds `config` then serves until `shutdown` (see [`Proxy::run`]).
pub async fn serve_until(
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ProxyError> {
    Proxy::bind(config).await?.run(shutdown).await
}

/// Builds the state of `config`, at startup and on every reload, with the
/// process's `metrics`. On a reload, `previous` is the state and config in force:
/// API keys and model concurrency limits whose settings are unchanged keep their
/// live state, and when the models (and what their instances are built from)
/// are unchanged, the model registry itself carries over (pools, KV indexes,
/// health and discovered instances).
pub(crate) fn build_state(
    config: &Config,
    metrics: &Metrics,
    previous: Option<(&State, &Config)>,
) -> Result<(State, Arc<PoolBuilder>), ProxyError> {
    let settings = PeerSettings {
        connect_timeout: config.limits.connect_timeout,
    };
    let dynamic = is_dynamic(config);
    let builder = Arc::new(PoolBuilder::new(
        metrics.clone(),
        settings,
        config.events.kind != EventsKind::None,
    ));
    let default_model = &config.discovery.default_model;
    let carried = previous
        .filter(|(_, old)| same_models(old, config))
        .map(|(state, _)| Arc::clone(&state.registry));
    let registry = match carried {
        Some(registry) => registry,
        None => {
            if dynamic && let Some(dir) = &default_model.tokenizer {
                builder.tokenizer("discovery.default_model", dir)?;
            }
            // With a control plane, a reload keeps what the pools learned at run time.
            let kept = previous
                .filter(|(_, old)| has_control_plane(old) && has_control_plane(config))
                .map(|(state, old)| (&*state.registry, old));
            let pools = model_pools(config, &builder, kept)?;
            Arc::new(ModelRegistry::new(pools, metrics))
        }
    };
    let pools = registry.pools();
    let mut instance_count: usize = pools.iter().map(|pool| pool.instances().len()).sum();
    let any_kv = pools
        .iter()
        .any(|pool| pool.balancer().kv_router().is_some());
    let any_kv = any_kv || (dynamic && default_model.effective_policy() == PolicyKind::Kv);
    if dynamic {
        instance_count = instance_count.max(DYNAMIC_INSTANCES_HINT);
    }
    let previous = previous.map(|(state, _)| state);
    // A reload keeps the tokenizer threads and, with the same settings, the engine
    // connections: swapping them would make every request after it reconnect.
    let preprocess = match previous.and_then(|state| state.preprocess.as_ref()) {
        Some(pool) if any_kv => Some(Arc::clone(pool)),
        _ => any_kv
            .then(PreprocessPool::per_core)
            .transpose()
            .map_err(ProxyError::Threads)?
            .map(Arc::new),
    };
    let settings = UpstreamSettings::new(
        config.upstream.pool_size,
        instance_count,
        config.upstream.pool_idle_timeout,
        upstream_ca_file(&config.upstream.tls)?,
    );
    let upstream = match previous {
        Some(state) if *state.upstream.settings() == settings => Arc::clone(&state.upstream),
        _ => Arc::new(Upstream::new(settings)),
    };
    let state = State {
        registry,
        upstream,
        metrics: metrics.clone(),
        request_ids: RequestIds::new(),
        limits: config.limits.clone(),
        engine_routes: EngineRoutes::new(&config.engine_routes),
        retry: RetryPolicy::new(&config.retry),
        outlier: OutlierPolicy::new(&config.outlier_detection),
        health_interval_ms: interval_ms(&config.health_check),
        preprocess,
        auth: Authenticator::new(config, &metrics.edge, previous.map(|state| &state.auth)),
        concurrency: ConcurrencyLimits::new(
            config,
            &metrics.edge,
            previous.map(|state| &state.concurrency),
        ),
        tracer: previous.and_then(|state| state.tracer.clone()),
    };
    Ok((state, builder))
}

/// Starts exporting spans when `telemetry` names an OTLP endpoint (counted in `metrics`).
fn start_telemetry(
    telemetry: &TelemetryConfig,
    metrics: &Metrics,
) -> Result<Option<Telemetry>, ProxyError> {
    let Some(endpoint) = &telemetry.otlp_endpoint else {
        return Ok(None);
    };
    let settings = TraceSettings {
        otlp_endpoint: endpoint.clone(),
        sampling_ratio: telemetry.sampling_ratio,
        service_name: telemetry.service_name.clone(),
        export_interval: telemetry.export_interval,
        export_timeout: telemetry.export_timeout,
        max_queue_size: telemetry.max_queue_size,
    };
    Telemetry::start(&settings, Vec::new(), metrics.trace_spans.clone())
        .map(Some)
        .map_err(ProxyError::Telemetry)
}

/// The pools of `config`'s models. With `kept` (a reload with a control plane: the registry
/// and config in force), a model whose config is unchanged keeps its pool as it is (its
/// instances, KV index and load); a changed one gets a new pool that takes over the old
/// pool's instances (their KV index is then rebuilt from the agents' snapshots); a model
/// that discovery serves and the config does not list keeps its pool.
fn model_pools(
    config: &Config,
    builder: &PoolBuilder,
    kept: Option<(&ModelRegistry, &Config)>,
) -> Result<Vec<NamedPool>, ProxyError> {
    let mut pools = Vec::new();
    for model in StaticDiscovery::new(config).models()? {
        let previous = kept.and_then(|(registry, old)| {
            let pool = registry
                .get(&model.name)
                .filter(|pool| pool.name() == model.name)?;
            let before = listed(old, &model.name);
            let unchanged = before.is_some() && before == listed(config, &model.name);
            Some((pool, unchanged))
        });
        let pool = match previous {
            Some((pool, true)) => pool,
            Some((old, false)) => {
                let pool = builder.pool(&model)?;
                pool.adopt_instances(&old);
                pool
            }
            None => builder.pool(&model)?,
        };
        pools.push((pool, model.aliases.clone()));
    }
    if let Some((registry, old)) = kept {
        for pool in registry.pools() {
            if listed(old, pool.name()).is_none() && listed(config, pool.name()).is_none() {
                pools.push((pool, Vec::new()));
            }
        }
    }
    Ok(pools)
}

/// The model named `name` in `config`'s `models`.
fn listed<'a>(config: &'a Config, name: &str) -> Option<&'a ModelConfig> {
    config.models.iter().find(|model| model.name == name)
}

/// Whether the model pools of `old` serve `new` as they are: the same models,
/// instance settings and control plane.
pub(crate) fn same_models(old: &Config, new: &Config) -> bool {
    old.models == new.models
        && old.limits.connect_timeout == new.limits.connect_timeout
        && old.discovery == new.discovery
        && old.events == new.events
}

/// Whether instances can come and go at run time (their pools cannot be rebuilt by a reload).
pub(crate) fn has_control_plane(config: &Config) -> bool {
    config.discovery.kind != DiscoveryKind::Static || config.events.kind != EventsKind::None
}

/// Starts `state`'s background tasks (health probes of its instances, KV
/// sweepers, tokenizer checks of instances not checked yet); they end when the returned set
/// is dropped or aborted.
pub(crate) fn spawn_state_tasks(state: &Arc<State>, config: &Config) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    if config.health_check.enabled {
        spawn_probes(state, &Arc::new(config.health_check.clone()), &mut tasks);
    }
    spawn_sweepers(state, &mut tasks);
    spawn_tokenizer_checks(state, &mut tasks);
    tasks
}

/// Each data listener's TLS, with its files read and checked.
fn listener_tls(
    config: &Config,
    metrics: &Metrics,
) -> Result<Vec<Option<Arc<ListenerTls>>>, ProxyError> {
    config
        .listeners
        .iter()
        .enumerate()
        .map(|(i, listener)| {
            let Some(tls) = &listener.tls else {
                return Ok(None);
            };
            let settings = TlsSettings::load(tls, &format!("listeners[{i}].tls"))?;
            let metrics = metrics.edge.tls(&listener.name);
            Ok(Some(Arc::new(ListenerTls {
                listener: listener.name.clone(),
                terminator: Arc::new(TlsTerminator::new(
                    settings,
                    metrics.certificate_expiry.clone(),
                )),
                metrics,
            })))
        })
        .collect()
}

/// The endpoint picker's own TLS, when `epp.tls` is set (its files are watched with the data
/// listeners'; changing the paths needs a restart, as `epp` does).
fn epp_tls(config: &Config, metrics: &Metrics) -> Result<Option<Arc<ListenerTls>>, ProxyError> {
    let Some(tls) = &config.epp.tls else {
        return Ok(None);
    };
    let settings = TlsSettings::load(tls, "epp.tls")?;
    let metrics = metrics.edge.tls(EPP_LISTENER);
    Ok(Some(Arc::new(ListenerTls {
        listener: EPP_LISTENER.to_string(),
        terminator: Arc::new(TlsTerminator::new(
            settings,
            metrics.certificate_expiry.clone(),
        )),
        metrics,
    })))
}

async fn bind(name: &str, address: SocketAddr) -> Result<TcpListener, ProxyError> {
    TcpListener::bind(address)
        .await
        .map_err(|source| ProxyError::Bind {
            name: name.to_string(),
            address,
            source,
        })
}

fn local_address(
    socket: &TcpListener,
    name: &str,
    address: SocketAddr,
) -> Result<SocketAddr, ProxyError> {
    socket.local_addr().map_err(|source| ProxyError::Bind {
        name: name.to_string(),
        address,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        let yaml = format!(
            "models:\n  - name: m\n    backends:\n      - url: http://127.0.0.1:9\n{extra}"
        );
        Config::from_yaml_str(&yaml, "test.yaml").expect("config")
    }

    #[test]
    fn a_reload_keeps_the_engine_connections_unless_the_upstream_settings_change() {
        let metrics = Metrics::new().expect("metrics");
        let first = config("");
        let (state, _) = build_state(&first, &metrics, None).expect("state");

        let limits = config("limits:\n  max_body_bytes: 1000\n");
        let (kept, _) = build_state(&limits, &metrics, Some((&state, &first))).expect("reload");
        assert!(Arc::ptr_eq(&state.upstream, &kept.upstream));

        let resized = config("upstream:\n  pool_size: 7\n");
        let (rebuilt, _) = build_state(&resized, &metrics, Some((&state, &first))).expect("reload");
        assert!(!Arc::ptr_eq(&state.upstream, &rebuilt.upstream));
    }

    #[test]
    fn a_reload_keeps_the_tokenizer_threads() {
        let metrics = Metrics::new().expect("metrics");
        let kv = |extra: &str| {
            let yaml = format!(
                "models:\n  - name: m\n    policy: kv\n    backends:\n      - url: http://127.0.0.1:9\n{extra}"
            );
            Config::from_yaml_str(&yaml, "test.yaml").expect("config")
        };
        let first = kv("");
        let (state, _) = build_state(&first, &metrics, None).expect("state");
        let old = state.preprocess.as_ref().expect("a pool for policy kv");
        let (next, _) = build_state(
            &kv("limits:\n  max_body_bytes: 1000\n"),
            &metrics,
            Some((&state, &first)),
        )
        .expect("reload");
        assert!(Arc::ptr_eq(old, next.preprocess.as_ref().expect("kept")));
    }
}

//! The library entry point: bind the listeners, then serve until shutdown.

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_config::{Config, HealthCheckConfig};
use kvmesh_preprocess::ModelPreprocessor;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::ProxyError;
use crate::accept::{ListenerApps, serve};
use crate::admin_app::AdminApp;
use crate::data_app::DataApp;
use crate::discovery::{Discovery, ModelSpec, StaticDiscovery};
use crate::health_check::{interval_ms, spawn_probes};
use crate::instance::{Instance, PeerSettings};
use crate::kv_route::KvRouter;
use crate::kv_route::offload::PreprocessPool;
use crate::kv_route::sweeper::spawn_sweepers;
use crate::metrics::Metrics;
use crate::outlier::OutlierPolicy;
use crate::policy;
use crate::pool::{Balancer, ModelPool};
use crate::registry::ModelRegistry;
use crate::request_id::RequestIds;
use crate::state::State;
use crate::upstream::Upstream;

/// Name the admin listener is announced under.
pub const ADMIN_LISTENER: &str = "admin";

/// How long admin connections may linger after the data listeners drained.
const ADMIN_DRAIN: Duration = Duration::from_secs(1);

/// Token ids the tokenizer's segment cache keeps per model (about 5 bytes each: ~10 MB), so
/// the history of multi-turn conversations is not tokenized again on every turn.
const SEGMENT_CACHE_TOKENS: usize = 2_000_000;

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
    state: Arc<State>,
    data: Vec<TcpListener>,
    listeners: Vec<BoundListener>,
    admin: TcpListener,
    admin_address: SocketAddr,
    health_check: HealthCheckConfig,
    drain_timeout: Duration,
}

impl Proxy {
    /// Validates `config`, builds the model pools and binds every listener.
    /// Must be called inside a tokio runtime.
    pub async fn bind(config: Config) -> Result<Self, ProxyError> {
        config.validate()?;
        let models = StaticDiscovery::new(&config).models()?;
        let metrics = Metrics::new()?;
        let settings = PeerSettings {
            connect_timeout: config.limits.connect_timeout,
        };
        let mut pools = Vec::with_capacity(models.len());
        let mut instance_count = 0;
        for model in models {
            let instances: Vec<Arc<Instance>> = model
                .instances
                .iter()
                .map(|spec| {
                    let handles = metrics.instance(&model.name, spec.url.as_str());
                    Arc::new(Instance::new(
                        spec.url.clone(),
                        spec.address,
                        spec.protocol,
                        settings,
                        handles,
                    ))
                })
                .collect();
            instance_count += instances.len();
            let balancer = balancer(&model, &instances, &metrics)?;
            let pool = ModelPool::new(
                model.name.clone(),
                instances,
                balancer,
                metrics.model(&model.name),
            );
            pools.push((Arc::new(pool), model.aliases.clone()));
        }
        let any_kv = pools
            .iter()
            .any(|(pool, _)| matches!(pool.balancer(), Balancer::Kv(_)));
        let preprocess = any_kv
            .then(PreprocessPool::per_core)
            .transpose()
            .map_err(ProxyError::Threads)?;
        let registry = ModelRegistry::new(pools, &metrics);
        let upstream = Upstream::new(
            config.upstream.pool_size,
            instance_count,
            config.upstream.pool_idle_timeout,
        );
        let state = Arc::new(State {
            registry,
            upstream,
            metrics,
            request_ids: RequestIds::new(),
            limits: config.limits.clone(),
            outlier: OutlierPolicy::new(&config.outlier_detection),
            health_interval_ms: interval_ms(&config.health_check),
            preprocess,
        });
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
        Ok(Self {
            state,
            data,
            listeners,
            admin,
            admin_address,
            health_check: config.health_check,
            drain_timeout: config.shutdown.drain_timeout,
        })
    }

    /// The data listeners, in config order.
    pub fn listeners(&self) -> &[BoundListener] {
        &self.listeners
    }

    /// The admin listener's address.
    pub fn admin_address(&self) -> SocketAddr {
        self.admin_address
    }

    /// Writes `LISTENING <name> <addr>` for every data listener, then for
    /// `admin`, and flushes. (`READY` is the caller's to print.)
    pub fn announce(&self, out: &mut impl Write) -> std::io::Result<()> {
        for listener in &self.listeners {
            writeln!(out, "LISTENING {} {}", listener.name, listener.address)?;
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
        let first_bytes_timeout = self.state.limits.client_header_timeout;
        let mut probes = JoinSet::new();
        if self.health_check.enabled {
            spawn_probes(&self.state, &self.health_check, &mut probes);
        }
        spawn_sweepers(&self.state, &mut probes);
        let mut data_loops = JoinSet::new();
        for listener in self.data {
            let apps = ListenerApps {
                h1: Arc::new(DataApp::new(Arc::clone(&self.state), false)),
                h2c: Some(Arc::new(DataApp::new(Arc::clone(&self.state), true))),
                first_bytes_timeout,
                drain_timeout: self.drain_timeout,
            };
            data_loops.spawn(serve(listener, apps, data_rx.clone()));
        }
        let admin_apps = ListenerApps {
            h1: Arc::new(AdminApp::new(Arc::clone(&self.state), data_rx.clone())),
            h2c: None,
            first_bytes_timeout,
            drain_timeout: ADMIN_DRAIN,
        };
        let admin_loop = tokio::spawn(serve(self.admin, admin_apps, admin_rx));

        shutdown.await;
        tracing::info!(
            drain_timeout_ms = u64::try_from(self.drain_timeout.as_millis()).unwrap_or(u64::MAX),
            "shutting down: draining in-flight requests"
        );
        let _ = data_tx.send(true);
        while data_loops.join_next().await.is_some() {}
        let _ = admin_tx.send(true);
        if let Err(error) = admin_loop.await {
            tracing::warn!(%error, "admin listener task failed");
        }
        probes.abort_all();
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

/// Loads a tokenizer directory, with the segment cache on.
pub(crate) fn load_tokenizer(dir: &Path) -> Result<Arc<ModelPreprocessor>, String> {
    let loaded = ModelPreprocessor::from_dir(dir).map_err(|error| error.to_string())?;
    Ok(Arc::new(loaded.with_segment_cache(SEGMENT_CACHE_TOKENS)))
}

/// The model's balancer: its policy, or a KV router (loading its tokenizer).
fn balancer(
    model: &ModelSpec,
    instances: &[Arc<Instance>],
    metrics: &Metrics,
) -> Result<Balancer, ProxyError> {
    if let Some(policy) = policy::build(model.policy) {
        return Ok(Balancer::Policy(policy));
    }
    let tokenizer = match &model.tokenizer {
        Some(dir) => Some(load_tokenizer(dir).map_err(|reason| ProxyError::Tokenizer {
            model: model.name.clone(),
            dir: dir.display().to_string(),
            reason,
        })?),
        None => {
            tracing::warn!(
                model = %model.name,
                "policy kv without a tokenizer: chat requests and text prompts are routed by \
                 load alone (set `tokenizer: DIR`)"
            );
            None
        }
    };
    let urls: Vec<&str> = instances.iter().map(|i| i.url().as_str()).collect();
    let router = KvRouter::new(
        &model.kv,
        tokenizer,
        model.forward_token_ids,
        instances.len(),
        metrics.kv(&model.name, &urls),
    )
    .map_err(|error| ProxyError::KvSettings {
        model: model.name.clone(),
        reason: error.to_string(),
    })?;
    Ok(Balancer::Kv(Box::new(router)))
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

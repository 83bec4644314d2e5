//! Starting and stopping engines: [`spawn`], [`spawn_engines`], [`EngineHandle`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

use crate::config::{DisaggregationMode, SimConfig};
use crate::error::SimError;
use crate::http::{EngineState, RankParts, serve, serve_bootstrap};
use crate::kv_events::KvEventBatch;
use crate::kv_transfer::link::Link;
use crate::lora::LoraRegistry;
use crate::metrics::EngineMetrics;
use crate::scheduler::{self, EventSender, Interference, SchedulerCore};
use crate::timing::TimingModel;
use crate::tokenizer::Tokenizer;
use crate::zmq_events::{self, ZmqEvents};

/// KV event batches buffered per subscriber before a slow one starts missing batches.
const EVENT_BUFFER: usize = 4096;

/// A running engine. Dropping the handle stops the engine too (without waiting);
/// [`EngineHandle::stop`] stops it and waits for the server to wind down.
#[derive(Debug)]
pub struct EngineHandle {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    server: Option<JoinHandle<()>>,
    /// An SGLang prefill engine's bootstrap server: where it listens, and its task.
    bootstrap: Option<(SocketAddr, JoinHandle<()>)>,
    /// The engine cores, in data-parallel rank order.
    cores: Vec<Core>,
}

/// One engine core's tasks: its scheduler and KV event sockets.
#[derive(Debug)]
struct Core {
    scheduler: JoinHandle<()>,
    events: EventSender,
    zmq: Option<ZmqEvents>,
}

impl EngineHandle {
    /// The address the engine listens on (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where an SGLang prefill engine's bootstrap server listens
    /// (`--disaggregation-mode prefill`).
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.bootstrap.as_ref().map(|(addr, _)| *addr)
    }

    /// Its data-parallel ranks ([`SimConfig::dp_ranks`]).
    pub fn dp_ranks(&self) -> usize {
        self.cores.len()
    }

    /// Where the ZMQ PUB socket of the KV events of rank 0 listens, when publishing is on.
    pub fn kv_events_addr(&self) -> Option<SocketAddr> {
        self.rank_kv_events_addr(0)
    }

    /// Where the ZMQ ROUTER socket replaying rank 0's KV events listens, when configured.
    pub fn kv_replay_addr(&self) -> Option<SocketAddr> {
        self.rank_kv_replay_addr(0)
    }

    /// Where rank `rank`'s KV event PUB socket listens, when publishing is on.
    pub fn rank_kv_events_addr(&self, rank: usize) -> Option<SocketAddr> {
        self.cores.get(rank)?.zmq.as_ref().map(|z| z.events_addr)
    }

    /// Where rank `rank`'s KV event replay socket listens, when configured.
    pub fn rank_kv_replay_addr(&self, rank: usize) -> Option<SocketAddr> {
        self.cores
            .get(rank)?
            .zmq
            .as_ref()
            .and_then(|z| z.replay_addr)
    }

    /// Subscribes to rank 0's KV event batches (one per iteration that changed the cache).
    /// A subscriber more than 4,096 batches behind misses batches (`RecvError::Lagged`).
    pub fn subscribe_kv_events(&self) -> broadcast::Receiver<Arc<KvEventBatch>> {
        self.cores[0].events.subscribe()
    }

    /// [`Self::subscribe_kv_events`] of rank `rank`; `None` past the last rank.
    pub fn subscribe_rank_kv_events(
        &self,
        rank: usize,
    ) -> Option<broadcast::Receiver<Arc<KvEventBatch>>> {
        self.cores.get(rank).map(|core| core.events.subscribe())
    }

    /// Stops accepting, ends the schedulers (in-flight requests fail or end their streams),
    /// closes the KV event sockets and waits up to a few seconds for open connections to close.
    pub async fn stop(mut self) {
        self.halt();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
        if let Some((_, bootstrap)) = self.bootstrap.take() {
            let _ = bootstrap.await;
        }
    }

    fn halt(&self) {
        let _ = self.shutdown.send(true);
        for core in &self.cores {
            core.scheduler.abort();
            if let Some(zmq) = &core.zmq {
                zmq.stop();
            }
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Starts one engine serving `listener` (engine index 0: its ranks are labelled
/// `engine="<rank>"` and bind the KV event ports as configured plus the rank). Must be
/// called inside a Tokio runtime.
pub async fn spawn(config: SimConfig, listener: TcpListener) -> Result<EngineHandle, SimError> {
    config.validate()?;
    let tokenizer = Tokenizer::load(config.tokenizer.as_deref())?;
    start(config, tokenizer, listener, 0).await
}

/// Binds and starts `count` engines on `host`: ports `port`, `port + 1`, ... or, with port 0,
/// a free port each. With `N` = [`SimConfig::dp_ranks`], engine `i`'s rank `r` is the
/// process's engine core `i·N + r`: labelled `engine="i·N + r"` in the metrics, its KV event
/// sockets at the configured ports plus `i·N + r` (its batches carry `r`). The tokenizer is
/// loaded once and shared.
pub async fn spawn_engines(
    config: &SimConfig,
    host: IpAddr,
    port: u16,
    count: usize,
) -> Result<Vec<EngineHandle>, SimError> {
    config.validate()?;
    let tokenizer = Tokenizer::load(config.tokenizer.as_deref())?;
    let mut engines = Vec::with_capacity(count);
    for i in 0..count {
        let engine_port = if port == 0 {
            0
        } else {
            u16::try_from(usize::from(port) + i)
                .map_err(|_| SimError::InvalidConfig(format!("port {port} + {i} exceeds 65535")))?
        };
        let addr = SocketAddr::new(host, engine_port);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| SimError::Bind { addr, source })?;
        engines.push(start(config.clone(), tokenizer.clone(), listener, i).await?);
    }
    Ok(engines)
}

async fn start(
    mut config: SimConfig,
    tokenizer: Tokenizer,
    listener: TcpListener,
    index: usize,
) -> Result<EngineHandle, SimError> {
    let addr = listener.local_addr()?;
    let bootstrap = bind_bootstrap(&mut config, addr, index).await?;
    // Each engine has its own adapters, as separate vLLM servers do; validated by the caller.
    let loras = LoraRegistry::new(config.enable_lora, &config.lora_modules)
        .map_err(|e| SimError::InvalidConfig(format!("lora_modules: {e}")))?;
    let mut cores = Vec::with_capacity(config.dp_ranks);
    let mut parts = Vec::with_capacity(config.dp_ranks);
    for rank in 0..config.dp_ranks {
        let (core, rank_parts) = start_core(&config, index * config.dp_ranks + rank, rank).await?;
        cores.push(core);
        parts.push(rank_parts);
    }
    let state = Arc::new(EngineState::new(config, tokenizer, loras, parts, addr));
    let (shutdown, shutdown_rx) = watch::channel(false);
    let bootstrap = match bootstrap {
        Some(listener) => {
            let at = listener.local_addr()?;
            let server = serve_bootstrap(listener, state.clone(), shutdown_rx.clone());
            Some((at, tokio::spawn(server)))
        }
        None => None,
    };
    let server = tokio::spawn(serve(listener, state, shutdown_rx));
    tracing::info!(%addr, index, "engine started");
    Ok(EngineHandle {
        addr,
        shutdown,
        server: Some(server),
        bootstrap,
        cores,
    })
}

/// Binds an SGLang prefill engine's bootstrap server on the engine's IP, at the configured
/// port plus the engine's `index` (port 0: a free one), and records the port it got in
/// `config`.
async fn bind_bootstrap(
    config: &mut SimConfig,
    addr: SocketAddr,
    index: usize,
) -> Result<Option<TcpListener>, SimError> {
    let sglang = &mut config.kv_transfer.sglang;
    if sglang.mode != DisaggregationMode::Prefill {
        return Ok(None);
    }
    let port = match sglang.bootstrap_port {
        0 => 0,
        port => u16::try_from(usize::from(port) + index).map_err(|_| {
            SimError::InvalidConfig(format!("bootstrap port {port} + {index} exceeds 65535"))
        })?,
    };
    let at = SocketAddr::new(addr.ip(), port);
    let listener = TcpListener::bind(at)
        .await
        .map_err(|source| SimError::Bind { addr: at, source })?;
    sglang.bootstrap_port = listener.local_addr()?.port();
    Ok(Some(listener))
}

/// Starts the process's engine core `index`, data-parallel rank `rank` of its engine.
async fn start_core(
    config: &SimConfig,
    index: usize,
    rank: usize,
) -> Result<(Core, RankParts), SimError> {
    let metrics = Arc::new(EngineMetrics::new(config, index));
    let (events, _) = broadcast::channel(EVENT_BUFFER);
    let dp_rank = u32::try_from(rank)
        .map_err(|_| SimError::InvalidConfig(format!("data-parallel rank {rank} is too large")))?;
    // Subscribed before the scheduler runs, so the publisher sees every batch from the first.
    let zmq = zmq_events::start(
        &config.kv_events,
        index,
        dp_rank,
        events.subscribe(),
        metrics.clone(),
    )
    .await?;
    let core = SchedulerCore::new(config, metrics.clone(), events.clone());
    let timing = (!config.no_delay).then(|| {
        TimingModel::new(
            config.speedup_ratio,
            config.decode_speedup_ratio,
            config.offload.load_cost,
        )
    });
    let link = Arc::new(Link::new(config.kv_transfer.link_gbps, !config.no_delay));
    let interference = Interference {
        link: link.clone(),
        factor: config.kv_transfer.interference,
        scaling: config.kv_transfer.interference_scaling,
    };
    let (handle, scheduler) = scheduler::spawn(core, timing, interference);
    let parts = RankParts {
        scheduler: handle,
        metrics,
        kv_faults: zmq.as_ref().map(|z| z.faults.clone()),
        kv_event_addrs: zmq.as_ref().map(|z| (z.events_addr, z.replay_addr)),
        link,
    };
    Ok((
        Core {
            scheduler,
            events,
            zmq,
        },
        parts,
    ))
}

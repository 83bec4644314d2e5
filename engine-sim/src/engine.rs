//! Starting and stopping engines: [`spawn`], [`spawn_engines`], [`EngineHandle`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

use crate::config::SimConfig;
use crate::error::SimError;
use crate::http::{EngineState, SideChannels, serve};
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
    scheduler: JoinHandle<()>,
    events: EventSender,
    zmq: Option<ZmqEvents>,
}

impl EngineHandle {
    /// The address the engine listens on (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the ZMQ PUB socket of the KV events listens, when publishing is on.
    pub fn kv_events_addr(&self) -> Option<SocketAddr> {
        self.zmq.as_ref().map(|z| z.events_addr)
    }

    /// Where the ZMQ ROUTER socket replaying KV events listens, when configured.
    pub fn kv_replay_addr(&self) -> Option<SocketAddr> {
        self.zmq.as_ref().and_then(|z| z.replay_addr)
    }

    /// Subscribes to the engine's KV event batches (one per iteration that changed the cache).
    /// A subscriber more than 4,096 batches behind misses batches (`RecvError::Lagged`).
    pub fn subscribe_kv_events(&self) -> broadcast::Receiver<Arc<KvEventBatch>> {
        self.events.subscribe()
    }

    /// Stops accepting, ends the scheduler (in-flight requests fail or end their streams),
    /// closes the KV event sockets and waits up to a few seconds for open connections to close.
    pub async fn stop(mut self) {
        self.halt();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }

    fn halt(&self) {
        let _ = self.shutdown.send(true);
        self.scheduler.abort();
        if let Some(zmq) = &self.zmq {
            zmq.stop();
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Starts one engine serving `listener` (engine index 0: the `engine` metric label, and the
/// KV event ports as configured). Must be called inside a Tokio runtime.
pub async fn spawn(config: SimConfig, listener: TcpListener) -> Result<EngineHandle, SimError> {
    config.validate()?;
    let tokenizer = Tokenizer::load(config.tokenizer.as_deref())?;
    start(config, tokenizer, listener, 0).await
}

/// Binds and starts `count` engines on `host`: ports `port`, `port + 1`, ... or, with port 0,
/// a free port each. Engine `i` is labelled `engine="i"` in its metrics and binds its KV event
/// sockets at the configured ports plus `i`. The tokenizer is loaded once and shared.
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
    config: SimConfig,
    tokenizer: Tokenizer,
    listener: TcpListener,
    index: usize,
) -> Result<EngineHandle, SimError> {
    let addr = listener.local_addr()?;
    // Each engine has its own adapters, as separate vLLM servers do; validated by the caller.
    let loras = LoraRegistry::new(config.enable_lora, &config.lora_modules)
        .map_err(|e| SimError::InvalidConfig(format!("lora_modules: {e}")))?;
    let metrics = Arc::new(EngineMetrics::new(&config, index));
    let (events, _) = broadcast::channel(EVENT_BUFFER);
    // Subscribed before the scheduler runs, so the publisher sees every batch from the first.
    let zmq = zmq_events::start(
        &config.kv_events,
        index,
        events.subscribe(),
        metrics.clone(),
    )
    .await?;
    let core = SchedulerCore::new(&config, metrics.clone(), events.clone());
    let timing = (!config.no_delay)
        .then(|| TimingModel::new(config.speedup_ratio, config.decode_speedup_ratio));
    let link = Arc::new(Link::new(config.kv_transfer.link_gbps, !config.no_delay));
    let interference = Interference {
        link: link.clone(),
        factor: config.kv_transfer.interference,
        scaling: config.kv_transfer.interference_scaling,
    };
    let (handle, scheduler) = scheduler::spawn(core, timing, interference);
    let faults = zmq.as_ref().map(|z| z.faults.clone());
    let side = SideChannels {
        kv_faults: faults,
        link,
    };
    let state = Arc::new(EngineState::new(
        config, tokenizer, loras, metrics, handle, addr, side,
    ));
    let (shutdown, shutdown_rx) = watch::channel(false);
    let server = tokio::spawn(serve(listener, state, shutdown_rx));
    tracing::info!(%addr, index, "engine started");
    Ok(EngineHandle {
        addr,
        shutdown,
        server: Some(server),
        scheduler,
        events,
        zmq,
    })
}

//! Starting and stopping engines: [`spawn`], [`spawn_engines`], [`EngineHandle`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

use crate::config::SimConfig;
use crate::error::SimError;
use crate::http::{EngineState, serve};
use crate::kv_events::KvEventBatch;
use crate::metrics::EngineMetrics;
use crate::scheduler::{self, EventSender, SchedulerCore};
use crate::timing::TimingModel;
use crate::tokenizer::Tokenizer;

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
}

impl EngineHandle {
    /// The address the engine listens on (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Subscribes to the engine's KV event batches (one per iteration that changed the cache).
    /// A subscriber more than 4,096 batches behind misses batches (`RecvError::Lagged`).
    pub fn subscribe_kv_events(&self) -> broadcast::Receiver<Arc<KvEventBatch>> {
        self.events.subscribe()
    }

    /// Stops accepting, ends the scheduler (in-flight requests fail or end their streams) and
    /// waits up to a few seconds for open connections to close.
    pub async fn stop(mut self) {
        let _ = self.shutdown.send(true);
        self.scheduler.abort();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        self.scheduler.abort();
    }
}

/// Starts one engine serving `listener`. Must be called inside a Tokio runtime.
pub async fn spawn(config: SimConfig, listener: TcpListener) -> Result<EngineHandle, SimError> {
    config.validate()?;
    let tokenizer = Tokenizer::load(config.tokenizer.as_deref())?;
    start(config, tokenizer, listener)
}

/// Binds and starts `count` engines on `host`: ports `port`, `port + 1`, ... or, with port 0,
/// a free port each. The tokenizer is loaded once and shared.
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
        engines.push(start(config.clone(), tokenizer.clone(), listener)?);
    }
    Ok(engines)
}

fn start(
    config: SimConfig,
    tokenizer: Tokenizer,
    listener: TcpListener,
) -> Result<EngineHandle, SimError> {
    let addr = listener.local_addr()?;
    let metrics = Arc::new(EngineMetrics::new(&config));
    let (events, _) = broadcast::channel(EVENT_BUFFER);
    let core = SchedulerCore::new(&config, metrics.clone(), events.clone());
    let timing = (!config.no_delay)
        .then(|| TimingModel::new(config.speedup_ratio, config.decode_speedup_ratio));
    let (handle, scheduler) = scheduler::spawn(core, timing);
    let state = Arc::new(EngineState::new(config, tokenizer, metrics, handle, addr));
    let (shutdown, shutdown_rx) = watch::channel(false);
    let server = tokio::spawn(serve(listener, state, shutdown_rx));
    tracing::info!(%addr, "engine started");
    Ok(EngineHandle {
        addr,
        shutdown,
        server: Some(server),
        scheduler,
        events,
    })
}

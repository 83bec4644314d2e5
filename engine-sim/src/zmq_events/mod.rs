//! KV events over ZMQ in vLLM's wire format (wire-formats.md §1): one PUB socket per engine
//! core (data-parallel rank) sending `[topic, seq u64 BE, msgpack batch]`, an optional ROUTER socket replaying the last
//! batches, and test-only fault injection.

mod control;
mod publisher;
mod replay;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket};

pub(crate) use control::FaultControl;

use publisher::Publisher;
use replay::ReplayBuffer;
use wire::WireFormat;

use crate::config::KvEventsConfig;
use crate::endpoint::TcpEndpoint;
use crate::error::SimError;
use crate::kv_events::KvEventBatch;
use crate::metrics::EngineMetrics;

/// The running ZMQ sockets of one engine core.
#[derive(Debug)]
pub(crate) struct ZmqEvents {
    /// Where the PUB socket listens.
    pub events_addr: SocketAddr,
    /// Where the replay ROUTER socket listens, if configured.
    pub replay_addr: Option<SocketAddr>,
    /// Fault injection into the publisher.
    pub faults: Arc<FaultControl>,
    tasks: Vec<JoinHandle<()>>,
}

impl ZmqEvents {
    /// Stops publishing and closes the sockets.
    pub(crate) fn stop(&self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn zmq_error(what: &str, e: zeromq::ZmqError) -> SimError {
    SimError::KvEvents(format!("{what}: {e}"))
}

/// Binds the sockets of the process's engine core `index` (at the configured ports plus
/// `index`) and starts publishing `events` as data-parallel rank `dp_rank`; `None` when
/// publishing is off. Must be called inside a Tokio runtime.
pub(crate) async fn start(
    config: &KvEventsConfig,
    index: usize,
    dp_rank: u32,
    events: broadcast::Receiver<Arc<KvEventBatch>>,
    metrics: Arc<EngineMetrics>,
) -> Result<Option<ZmqEvents>, SimError> {
    let Some(endpoint) = &config.endpoint else {
        return Ok(None);
    };
    let invalid = |e: String| SimError::InvalidConfig(e);
    let listener = TcpEndpoint::parse(endpoint).map_err(invalid)?.bind(index)?;
    let events_addr = listener.local_addr()?;
    let mut socket = PubSocket::new();
    socket
        .bind_listener(listener)
        .await
        .map_err(|e| zmq_error("cannot start the KV event PUB socket", e))?;
    let mut tasks = Vec::with_capacity(2);
    let (replay, replay_addr) = match &config.replay_endpoint {
        Some(replay_endpoint) => {
            let listener = TcpEndpoint::parse(replay_endpoint)
                .map_err(invalid)?
                .bind(index)?;
            let addr = listener.local_addr()?;
            let mut router = RouterSocket::new();
            router
                .bind_listener(listener)
                .await
                .map_err(|e| zmq_error("cannot start the KV event replay socket", e))?;
            let buffer = Arc::new(ReplayBuffer::new(config.buffer_steps));
            let topic = Bytes::from(config.topic.clone().into_bytes());
            tasks.push(tokio::spawn(replay::serve(router, buffer.clone(), topic)));
            (Some(buffer), Some(addr))
        }
        None => (None, None),
    };
    let faults = Arc::new(FaultControl::default());
    let publisher = Publisher {
        socket,
        events,
        topic: Bytes::from(config.topic.clone().into_bytes()),
        format: WireFormat {
            encoding: config.encoding,
            hash: config.hash,
        },
        replay,
        faults: faults.clone(),
        metrics,
        next_seq: 0,
        dp_rank,
    };
    tasks.push(tokio::spawn(publisher.run()));
    tracing::info!(%events_addr, ?replay_addr, dp_rank, "publishing KV events");
    Ok(Some(ZmqEvents {
        events_addr,
        replay_addr,
        faults,
        tasks,
    }))
}

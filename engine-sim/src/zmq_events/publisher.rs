//! The PUB side: turns the engine's event batches into 3-frame ZMQ messages
//! `[topic, seq u64 BE, msgpack batch]`, off the scheduler's path.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::broadcast::{self, error::RecvError};
use zeromq::{PubSocket, SocketSend, ZmqMessage};

use super::control::FaultControl;
use super::replay::ReplayBuffer;
use super::wire::{WireFormat, encode_batch};
use crate::kv_events::{KvEvent, KvEventBatch};
use crate::metrics::EngineMetrics;

/// One engine's publisher: sequence numbering, replay buffering and fault injection.
pub(crate) struct Publisher {
    /// The bound PUB socket.
    pub socket: PubSocket,
    /// The engine's event batches.
    pub events: broadcast::Receiver<Arc<KvEventBatch>>,
    /// First frame of every message.
    pub topic: Bytes,
    /// Event layout.
    pub format: WireFormat,
    /// Batches kept for the replay socket, when there is one.
    pub replay: Option<Arc<ReplayBuffer>>,
    /// Pending test-only faults.
    pub faults: Arc<FaultControl>,
    /// Publishing counters.
    pub metrics: Arc<EngineMetrics>,
    /// Sequence number of the next batch.
    pub next_seq: u64,
    /// The engine core's data-parallel rank, written into every batch.
    pub dp_rank: u32,
}

impl Publisher {
    /// Publishes until the engine's event channel closes.
    pub(crate) async fn run(mut self) {
        loop {
            match self.events.recv().await {
                Ok(batch) => self.publish(&batch).await,
                Err(RecvError::Lagged(missed)) => {
                    // The batches are gone: skip their numbers so subscribers see the gap.
                    tracing::warn!(missed, "KV event publisher fell behind the engine");
                    self.metrics.kv_batches_lagged(missed);
                    self.next_seq = self.next_seq.wrapping_add(missed);
                }
                Err(RecvError::Closed) => return,
            }
        }
    }

    async fn publish(&mut self, batch: &KvEventBatch) {
        if batch.engine_restarted {
            self.next_seq = 0;
            if let Some(replay) = &self.replay {
                replay.clear();
            }
        }
        self.send(batch.timestamp, &batch.events).await;
        let first_store = batch
            .events
            .iter()
            .find(|e| matches!(e, KvEvent::BlockStored { .. }));
        if let Some(store) = first_store
            && self.faults.take_duplicate()
        {
            self.send(batch.timestamp, std::slice::from_ref(store))
                .await;
        }
    }

    async fn send(&mut self, timestamp: f64, events: &[KvEvent]) {
        let seq = self.next_seq;
        self.next_seq = seq.wrapping_add(1);
        let mut buf = Vec::with_capacity(256);
        encode_batch(&mut buf, self.format, timestamp, events, self.dp_rank);
        let payload = Bytes::from(buf);
        if let Some(replay) = &self.replay {
            replay.push(seq, payload.clone());
        }
        if self.faults.take_drop() {
            self.metrics.kv_batch_fault_dropped();
            return;
        }
        let mut msg = ZmqMessage::from(self.topic.clone());
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload);
        match self.socket.send(msg).await {
            Ok(()) => self.metrics.kv_batch_sent(),
            Err(e) => tracing::warn!(error = %e, seq, "cannot publish a KV event batch"),
        }
    }
}

#[cfg(test)]
mod tests {
    use zeromq::Socket;

    use super::*;
    use crate::config::{KvEventEncoding, KvEventHash, SimConfig};

    fn batch() -> Arc<KvEventBatch> {
        Arc::new(KvEventBatch {
            timestamp: 1.0,
            events: vec![KvEvent::AllBlocksCleared],
            engine_restarted: false,
        })
    }

    #[tokio::test]
    async fn a_lagging_publisher_skips_the_lost_numbers_and_counts_them() {
        let (tx, events) = broadcast::channel(1);
        for _ in 0..3 {
            let _ = tx.send(batch());
        }
        drop(tx);
        let mut config = SimConfig::default();
        config.kv_events.endpoint = Some("tcp://127.0.0.1:0".to_owned());
        let metrics = Arc::new(EngineMetrics::new(&config, 0));
        let replay = Arc::new(ReplayBuffer::new(8));
        let publisher = Publisher {
            socket: PubSocket::new(),
            events,
            topic: Bytes::new(),
            format: WireFormat {
                encoding: KvEventEncoding::Positional,
                hash: KvEventHash::Int,
            },
            replay: Some(replay.clone()),
            faults: Arc::new(FaultControl::default()),
            metrics: metrics.clone(),
            next_seq: 0,
            dp_rank: 0,
        };
        // Returns once the channel is closed and drained; the engine side never waited.
        publisher.run().await;
        let seqs: Vec<u64> = replay.since(0).into_iter().map(|(s, _)| s).collect();
        assert_eq!(seqs, vec![2]);
        let text = metrics.render();
        assert!(
            text.contains(
                "kvmesh_sim_kv_event_batches_lagged_total{engine=\"0\",model_name=\"sim-model\"} 2"
            ),
            "{text}"
        );
    }
}

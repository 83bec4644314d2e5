//! The agent's event path without sockets or tasks, for benchmarks and tests: decode an engine
//! payload, translate it, number and encode the batch exactly as the running agent does.

use std::time::Instant;

use bytes::Bytes;
use kvmesh_control::{InstanceId, SnapshotReply, SnapshotRequest};
use kvmesh_engine_events::decode_batch;
use tokio::sync::mpsc;

use crate::config::EngineKind;
use crate::core::{Core, Outgoing};
use crate::error::AgentError;
use crate::metrics::AgentMetrics;

/// Decode → translate → publish-encode, synchronously.
pub struct Pipeline {
    kind: EngineKind,
    core: Core,
    published: mpsc::Receiver<Outgoing>,
    metrics: AgentMetrics,
}

impl Pipeline {
    /// A pipeline for an engine of `kind` with `dp_ranks` ranks of `block_size`-token blocks.
    pub fn new(kind: EngineKind, dp_ranks: u32, block_size: usize) -> Result<Self, AgentError> {
        let metrics = AgentMetrics::new()?;
        // Room for one batch: `push` takes each one out right away.
        let (tx, published) = mpsc::channel(1);
        let core = Core::new(InstanceId(1), dp_ranks, block_size, tx, metrics.clone())
            .map_err(|e| AgentError::Config(e.to_string()))?;
        Ok(Self {
            kind,
            core,
            published,
            metrics,
        })
    }

    /// Processes one engine payload of rank `rank`; returns the JSON batch the agent would
    /// publish (`None` when the payload is malformed or yields no event).
    pub fn push(&mut self, rank: u32, payload: &[u8]) -> Option<Bytes> {
        match decode_batch(self.kind.layout(), payload) {
            Ok(batch) => {
                self.core.apply(rank, &batch, Instant::now());
            }
            Err(_) => self.metrics.malformed.inc(),
        }
        self.published.try_recv().ok().map(|out| out.payload)
    }

    /// The answer the agent would give to a resync request.
    pub fn resync(&self, request: SnapshotRequest) -> SnapshotReply {
        self.core.resync(request)
    }

    /// The pipeline's metrics.
    pub fn metrics(&self) -> &AgentMetrics {
        &self.metrics
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_control::EventBatch;
    use kvmesh_kv::KvEvent;

    use super::*;
    use crate::core::RING_CAPACITY;

    fn batch(events: &[(&[u64], Option<u64>, std::ops::Range<u32>)], removed: &[u64]) -> Vec<u8> {
        let mut out = Vec::new();
        let _ = rmp::encode::write_array_len(&mut out, 3);
        let _ = rmp::encode::write_f64(&mut out, 0.0);
        let _ = rmp::encode::write_array_len(
            &mut out,
            (events.len() + usize::from(!removed.is_empty())) as u32,
        );
        for (ids, parent, tokens) in events {
            let _ = rmp::encode::write_array_len(&mut out, 5);
            let _ = rmp::encode::write_str(&mut out, "BlockStored");
            let _ = rmp::encode::write_array_len(&mut out, ids.len() as u32);
            for &id in *ids {
                let _ = rmp::encode::write_uint(&mut out, id);
            }
            match parent {
                Some(p) => {
                    let _ = rmp::encode::write_uint(&mut out, *p);
                }
                None => {
                    let _ = rmp::encode::write_nil(&mut out);
                }
            }
            let _ = rmp::encode::write_array_len(&mut out, tokens.len() as u32);
            for t in tokens.clone() {
                let _ = rmp::encode::write_uint(&mut out, u64::from(t));
            }
            let _ = rmp::encode::write_uint(&mut out, 4);
        }
        if !removed.is_empty() {
            let _ = rmp::encode::write_array_len(&mut out, 2);
            let _ = rmp::encode::write_str(&mut out, "BlockRemoved");
            let _ = rmp::encode::write_array_len(&mut out, removed.len() as u32);
            for &id in removed {
                let _ = rmp::encode::write_uint(&mut out, id);
            }
        }
        let _ = rmp::encode::write_nil(&mut out);
        out
    }

    #[test]
    fn batches_are_numbered_kept_and_snapshotted() {
        let mut p = Pipeline::new(EngineKind::Vllm, 1, 4).expect("pipeline");
        let first = p
            .push(0, &batch(&[(&[1, 2], None, 0..8)], &[]))
            .expect("published");
        let first = EventBatch::from_json(&first).expect("json");
        assert_eq!(first.seq, 1);
        // Unknown parent: nothing to publish, counted as a miss.
        assert!(p.push(0, &batch(&[(&[9], Some(77), 0..4)], &[])).is_none());
        assert_eq!(p.metrics().translation_misses.get(), 1);
        assert!(p.push(0, b"junk").is_none());
        assert_eq!(p.metrics().malformed.get(), 1);
        let second = p
            .push(0, &batch(&[(&[3], Some(2), 8..12)], &[1]))
            .expect("published");
        let second = EventBatch::from_json(&second).expect("json");
        assert_eq!(second.seq, 2);
        assert!(matches!(&second.events[1], KvEvent::Removed { blocks } if blocks.len() == 1));

        let SnapshotReply::Events { batches, last_seq } = p.resync(SnapshotRequest::from_seq(2))
        else {
            panic!("expected events");
        };
        assert_eq!((batches, last_seq), (vec![second], 2));
        let SnapshotReply::Events { batches, .. } = p.resync(SnapshotRequest::from_seq(9)) else {
            panic!("expected events");
        };
        assert!(batches.is_empty());
        let SnapshotReply::Snapshot { events, last_seq } = p.resync(SnapshotRequest::full()) else {
            panic!("expected a snapshot");
        };
        assert_eq!(last_seq, 2);
        // Blocks 2 and 3 remain; 3 chains from 2, whose parent (1) was evicted.
        assert_eq!(events.len(), 1);
        assert!(
            matches!(&events[0].event, KvEvent::Stored { blocks, parent: Some(_) } if blocks.len() == 2)
        );
    }

    #[test]
    fn replays_older_than_the_ring_get_a_snapshot() {
        let mut p = Pipeline::new(EngineKind::Vllm, 1, 4).expect("pipeline");
        for i in 0..(RING_CAPACITY as u64 + 10) {
            let ids = [1000 + i];
            p.push(0, &batch(&[(&ids, None, 0..4)], &[]))
                .expect("published");
        }
        assert!(matches!(
            p.resync(SnapshotRequest::from_seq(5)),
            SnapshotReply::Snapshot { .. }
        ));
        let SnapshotReply::Events { batches, .. } = p.resync(SnapshotRequest::from_seq(11)) else {
            panic!("seq 11 is still in the ring");
        };
        assert_eq!(batches.len(), RING_CAPACITY);
        assert_eq!(batches[0].seq, 11);
    }
}

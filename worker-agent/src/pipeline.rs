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
        // Room for one batch per cache tier: `push` takes them out right away.
        let (tx, published) = mpsc::channel(3);
        let core = Core::new(InstanceId(1), dp_ranks, block_size, tx, metrics.clone())
            .map_err(|e| AgentError::Config(e.to_string()))?;
        Ok(Self {
            kind,
            core,
            published,
            metrics,
        })
    }

    /// Processes one engine payload of rank `rank`; returns the JSON batches the agent would
    /// publish: one per cache tier the payload changed, the device's first (none when the
    /// payload is malformed or yields no event).
    pub fn push(&mut self, rank: u32, payload: &[u8]) -> Vec<Bytes> {
        match decode_batch(self.kind.layout(), payload) {
            Ok(batch) => {
                self.core.apply(rank, &batch, Instant::now());
            }
            Err(_) => self.metrics.malformed.inc(),
        }
        std::iter::from_fn(|| self.published.try_recv().ok())
            .map(|out| out.payload)
            .collect()
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
            .pop()
            .expect("published");
        let first = EventBatch::from_json(&first).expect("json");
        assert_eq!(first.seq, 1);
        // Unknown parent: nothing to publish, counted as a miss.
        assert!(p.push(0, &batch(&[(&[9], Some(77), 0..4)], &[])).is_empty());
        assert_eq!(p.metrics().translation_misses.get(), 1);
        assert!(p.push(0, b"junk").is_empty());
        assert_eq!(p.metrics().malformed.get(), 1);
        let second = p
            .push(0, &batch(&[(&[3], Some(2), 8..12)], &[1]))
            .pop()
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
            let first = 4 * i as u32;
            p.push(0, &batch(&[(&ids, None, first..first + 4)], &[]))
                .pop()
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

    /// Real vLLM 0.32.0 (CPU build) with its OffloadingConnector keeping blocks in host
    /// memory (captures in engine-events/tests/fixtures, README there): every KV event
    /// message, per step of the scenario, with the `cached_tokens` the engine answered.
    const OFFLOAD_SUMMARY: &str =
        include_str!("../../engine-events/tests/fixtures/vllm-0.32.0-offload.json");

    /// The payload frame of each message of a capture stream (per message three frames,
    /// topic, sequence number and payload, each a 4-byte big-endian length and its bytes),
    /// by the message's sequence number.
    fn capture_payloads(stream: &[u8]) -> std::collections::BTreeMap<u64, Vec<u8>> {
        let mut frames = Vec::new();
        let mut rest = stream;
        while let Some((len, tail)) = rest.split_first_chunk::<4>() {
            let len = u32::from_be_bytes(*len) as usize;
            frames.push(&tail[..len]);
            rest = &tail[len..];
        }
        frames
            .chunks(3)
            .map(|message| {
                let seq = u64::from_be_bytes(message[1].try_into().expect("an 8-byte seq"));
                (seq, message[2].to_vec())
            })
            .collect()
    }

    /// Plays capture `tag` through the agent's pipeline into an index, and checks before
    /// each request for prompt A that the index finds as many of A's blocks cached (device
    /// or host memory) as the engine then reported in `cached_tokens`.
    fn play_offload_capture(tag: &str, stream: &[u8]) {
        use kvmesh_kv::{BlockHasher, CacheTier, KvIndex, WorkerKey};
        let summary: serde_json::Value = serde_json::from_str(OFFLOAD_SUMMARY).expect("json");
        let block_size = summary["block_size"].as_u64().expect("block_size") as usize;
        let tokens: Vec<u32> = summary["prompt_A_token_ids"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("a token") as u32)
            .collect();
        let a = BlockHasher::new(block_size, None)
            .expect("hasher")
            .hash(&tokens)
            .sequence;
        assert_eq!(a.len(), 16);
        let payloads = capture_payloads(stream);
        let mut p = Pipeline::new(EngineKind::Vllm, 1, block_size).expect("pipeline");
        let index = KvIndex::new();
        let device = WorkerKey::new(1, 0);
        let host = device.in_tier(CacheTier::Host);
        let mut checked = 0;
        let mut host_only_hit = false;
        for step in summary["captures"][tag].as_array().expect("steps") {
            let name = step["step"].as_str().expect("step");
            if name.starts_with("A-") {
                let scores = index.find_matches(&a);
                let (on_device, in_host) = (scores.depth(device), scores.depth(host));
                let cached = step["cached_tokens"].as_u64().expect("cached_tokens");
                assert_eq!(
                    u64::from(on_device.max(in_host)) * block_size as u64,
                    cached,
                    "{tag} {name}: device {on_device}, host {in_host} blocks"
                );
                host_only_hit |= cached > 0 && on_device == 0;
                checked += 1;
            }
            for seq in step["seqs"].as_array().expect("seqs") {
                let payload = &payloads[&seq.as_u64().expect("seq")];
                for json in p.push(0, payload) {
                    let batch = EventBatch::from_json(&json).expect("batch");
                    let worker = WorkerKey::new(1, batch.dp_rank).in_tier(batch.tier);
                    for event in &batch.events {
                        index.apply(worker, event);
                    }
                }
            }
            // The engine's host memory holds 96 blocks: so does the agent's account of it.
            assert!(index.find_matches(&a).depth(host) <= 16);
            let kept = index
                .cached_blocks()
                .into_iter()
                .find(|(key, _)| *key == host)
                .map_or(0, |(_, blocks)| blocks);
            assert!(
                kept <= summary["cpu_blocks"].as_u64().expect("cpu_blocks"),
                "{tag} {name}: {kept}"
            );
        }
        assert_eq!(
            checked, 4,
            "{tag}: A first, again, after its eviction, last"
        );
        assert!(
            host_only_hit,
            "{tag}: A was served from host memory alone once"
        );
        // Every offloaded block was one the engine had stored on the device first.
        assert_eq!(p.metrics().translation_misses.get(), 0, "{tag}");
    }

    #[test]
    fn real_vllm_offloads_are_followed_block_for_block_in_host_memory() {
        play_offload_capture(
            "sd-bpc1",
            include_bytes!("../../engine-events/tests/fixtures/vllm-0.32.0-offload-sd-bpc1.stream"),
        );
        play_offload_capture(
            "sd-bpc2",
            include_bytes!("../../engine-events/tests/fixtures/vllm-0.32.0-offload-sd-bpc2.stream"),
        );
        play_offload_capture(
            "ph-bpc1",
            include_bytes!("../../engine-events/tests/fixtures/vllm-0.32.0-offload-ph-bpc1.stream"),
        );
    }
}

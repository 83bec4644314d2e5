//! KV event batches as the proxy takes them off NATS (`EventBatch::from_json_at`, the live form
//! with `at_ms`; `from_json`, the form inside resync replies), then applied to a KV index as
//! the proxy applies them.
//!
//! Whatever the bytes: nothing panics; a batch that parses writes back to JSON that parses to
//! the same batch (with and without `at_ms`); and the index, fed the batch's events, holds
//! nothing more once the instance is forgotten.

#![no_main]

use kvmesh_control::EventBatch;
use kvmesh_kv::{KvEvent, KvIndex, WorkerKey};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok((batch, at_ms)) = EventBatch::from_json_at(data) else {
        return;
    };
    // The live form is a batch with one more field.
    assert_eq!(EventBatch::from_json(data).ok(), Some(batch.clone()));
    assert_eq!(
        EventBatch::from_json(&batch.to_json()).ok(),
        Some(batch.clone())
    );
    let stamp = at_ms.unwrap_or(1);
    let mut live = Vec::new();
    batch.write_json_at(stamp, &mut live);
    assert_eq!(
        EventBatch::from_json_at(&live).ok(),
        Some((batch.clone(), Some(stamp)))
    );

    let index = KvIndex::with_shards(4);
    let worker = WorkerKey::new(batch.instance_id.0, batch.dp_rank).in_tier(batch.tier);
    let mut query = Vec::new();
    for event in &batch.events {
        index.apply(worker, event);
        if let KvEvent::Stored { blocks, .. } = event {
            query.extend(blocks.iter().map(|block| block.sequence));
        }
    }
    assert_eq!(
        batch.block_count(),
        batch
            .events
            .iter()
            .map(kvmesh_control::event_blocks)
            .sum::<usize>()
    );
    let scores = index.find_matches(&query);
    assert!(
        scores
            .workers
            .iter()
            .all(|overlap| overlap.depth as usize <= query.len())
    );
    index.remove_worker(worker.instance_id);
    let stats = index.stats();
    assert_eq!(
        (
            stats.workers,
            stats.distinct_blocks,
            stats.worker_blocks,
            stats.orphan_blocks
        ),
        (0, 0, 0, 0),
        "an instance forgotten leaves nothing behind"
    );
});

//! Lookups running while other threads apply events on the same blocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use kvmesh_kv::{
    BlockHasher, BlockParent, ExternalHash, KvEvent, KvIndex, SequenceHash, WorkerKey,
};

const STABLE: WorkerKey = WorkerKey::new(100, 0);

#[test]
fn lookups_stay_exact_for_workers_nobody_writes_to() {
    let tokens: Vec<u32> = (0..64 * 16).collect();
    let hashes = BlockHasher::new(16, None)
        .expect("block size")
        .hash(&tokens);
    let blocks: Vec<(ExternalHash, _)> = hashes
        .local
        .iter()
        .zip(&hashes.sequence)
        .map(|(&l, &s)| (ExternalHash(s.0), l))
        .collect();
    let index = Arc::new(KvIndex::with_shards(4));
    index.apply(STABLE, &KvEvent::stored(None, blocks.iter().copied()));
    let full = hashes.len() as u32;

    let done = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let index = Arc::clone(&index);
            let blocks = blocks.clone();
            let sequence = hashes.sequence.clone();
            thread::spawn(move || {
                let worker = WorkerKey::new(w, 0);
                for round in 0..300usize {
                    let cut = (round * 7 + w as usize) % blocks.len();
                    // Store the prefix in two events (the second names its parent), then
                    // evict the tail first and the head after, like an engine's LRU.
                    index.apply(
                        worker,
                        &KvEvent::stored(None, blocks[..cut].iter().copied()),
                    );
                    let parent = cut.checked_sub(1).map(|p| BlockParent {
                        external: blocks[p].0,
                        sequence: sequence[p],
                    });
                    index.apply(
                        worker,
                        &KvEvent::stored(parent, blocks[cut..].iter().copied()),
                    );
                    let mut ids: Vec<ExternalHash> = blocks.iter().map(|b| b.0).collect();
                    ids.reverse();
                    index.apply(worker, &KvEvent::Removed { blocks: ids });
                }
            })
        })
        .collect();
    let reader = {
        let index = Arc::clone(&index);
        let done = Arc::clone(&done);
        let query: Vec<SequenceHash> = hashes.sequence.clone();
        thread::spawn(move || {
            let mut lookups = 0u64;
            while !done.load(Ordering::Acquire) || lookups == 0 {
                let scores = index.find_matches(&query);
                assert_eq!(scores.depth(STABLE), full);
                assert!(scores.workers.iter().all(|o| o.depth <= full));
                lookups += 1;
            }
            lookups
        })
    };
    for writer in writers {
        writer.join().expect("writer panicked");
    }
    done.store(true, Ordering::Release);
    let lookups = reader.join().expect("reader panicked");
    assert!(lookups > 0);

    let scores = index.find_matches(&hashes.sequence);
    assert_eq!(
        scores.workers.len(),
        1,
        "writers removed everything they stored"
    );
    assert_eq!(scores.depth(STABLE), full);
    let stats = index.stats();
    assert_eq!(stats.distinct_blocks, hashes.len());
    assert_eq!(stats.orphan_blocks, 0);
}

//! Lookups running while other threads apply events on the same blocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use kvmesh_kv::{
    BlockHasher, BlockHashes, BlockParent, ExternalHash, IndexLimits, KvEvent, KvIndex,
    LocalBlockHash, OverlapScores, SequenceHash, WorkerKey,
};

const STABLE: WorkerKey = WorkerKey::new(100, 0);

/// A 64-block chain of 16-token blocks, and its blocks named by their own sequence hashes as
/// the worker-agent names them.
fn own_id_chain() -> (BlockHashes, Vec<(ExternalHash, LocalBlockHash)>) {
    let tokens: Vec<u32> = (0..64 * 16).collect();
    let hashes = BlockHasher::new(16, None)
        .expect("block size")
        .hash(&tokens);
    let blocks = hashes
        .local
        .iter()
        .zip(&hashes.sequence)
        .map(|(&l, &s)| (ExternalHash(s.0), l))
        .collect();
    (hashes, blocks)
}

/// A thread looking `query` up until `done` (at least once), checking each answer; it returns
/// how many lookups it made.
fn reader(
    index: &Arc<KvIndex>,
    done: &Arc<AtomicBool>,
    query: &[SequenceHash],
    check: impl Fn(&OverlapScores) + Send + 'static,
) -> thread::JoinHandle<u64> {
    let (index, done, query) = (Arc::clone(index), Arc::clone(done), query.to_vec());
    thread::spawn(move || {
        let mut lookups = 0u64;
        while !done.load(Ordering::Acquire) || lookups == 0 {
            check(&index.find_matches(&query));
            lookups += 1;
        }
        lookups
    })
}

#[test]
fn lookups_stay_exact_for_workers_nobody_writes_to() {
    let (hashes, blocks) = own_id_chain();
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
    let reader = reader(&index, &done, &hashes.sequence, move |scores| {
        assert_eq!(scores.depth(STABLE), full);
        assert!(scores.workers.iter().all(|o| o.depth <= full));
    });
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

#[test]
fn a_bounded_index_stays_consistent_under_concurrent_writers_and_lookups() {
    let (hashes, _) = own_id_chain();
    // Below one worker's 64 blocks, so the bound is passed however the threads interleave
    // (with 100, a scheduler that ran the writers one after another never passed it).
    const BOUND: u64 = 50;
    let index = Arc::new(KvIndex::with_limits(IndexLimits {
        max_blocks: Some(BOUND),
    }));
    let done = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..3u64)
        .map(|w| {
            let index = Arc::clone(&index);
            let hashes = hashes.clone();
            thread::spawn(move || {
                let worker = WorkerKey::new(w, 0);
                index.set_worker_capacity(worker, 20 + 10 * w);
                for round in 0..200u64 {
                    // Engine ids differ per round, so every event stores new pairs.
                    let blocks = hashes
                        .local
                        .iter()
                        .zip(&hashes.sequence)
                        .map(|(&l, &s)| (ExternalHash(s.0 ^ (round << 48 | w << 40)), l));
                    let cut = (round as usize * 7 + w as usize) % hashes.len() + 1;
                    index.apply(worker, &KvEvent::stored(None, blocks.take(cut)));
                    if round % 5 == 4 {
                        index.apply(worker, &KvEvent::Cleared);
                    }
                }
            })
        })
        .collect();
    let reader = reader(&index, &done, &hashes.sequence, move |scores| {
        assert!(scores.workers.iter().all(|o| o.depth <= 64));
    });
    for writer in writers {
        writer.join().expect("writer panicked");
    }
    done.store(true, Ordering::Release);
    assert!(reader.join().expect("reader panicked") > 0);
    let stats = index.stats();
    let held: u64 = index.cached_blocks().iter().map(|&(_, n)| n).sum();
    assert_eq!(stats.worker_blocks, held);
    assert!(stats.worker_blocks <= BOUND, "{stats:?}");
    assert!(stats.evicted_blocks > 0, "{stats:?}");
    // Each worker holds blocks of the one chain: blocks past its match depth are held, and at
    // least one of them (the first past a gap) is an orphan.
    for (worker, n) in index.cached_blocks() {
        let depth = u64::from(index.find_matches(&hashes.sequence).depth(worker));
        assert!(depth <= n);
    }
    let past_depth: u64 = index
        .cached_blocks()
        .iter()
        .map(|&(worker, n)| n - u64::from(index.find_matches(&hashes.sequence).depth(worker)))
        .sum();
    assert!(stats.orphan_blocks <= past_depth, "{stats:?}");
    assert_eq!(stats.orphan_blocks == 0, past_depth == 0, "{stats:?}");
}

#[test]
fn counts_stay_exact_while_two_writers_hand_blocks_to_each_other() {
    // Two workers store and drop the same chain at once, with nobody else holding it: each
    // block's owner (the holder whose counts live in the block's slot) changes hands
    // between them all the time, and clearing a worker scans the shards while the other
    // adds itself to the blocks it owns.
    let (hashes, blocks) = own_id_chain();
    let index = Arc::new(KvIndex::with_shards(4));
    let full = hashes.len() as u32;
    let done = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let index = Arc::clone(&index);
            let blocks = blocks.clone();
            thread::spawn(move || {
                let worker = WorkerKey::new(w, 0);
                for round in 0..300usize {
                    let cut = (round * 7 + w as usize) % blocks.len() + 1;
                    index.apply(
                        worker,
                        &KvEvent::stored(None, blocks[..cut].iter().copied()),
                    );
                    if round % 3 == 2 {
                        index.apply(worker, &KvEvent::Cleared);
                    } else {
                        let ids = blocks[..cut].iter().rev().map(|b| b.0).collect();
                        index.apply(worker, &KvEvent::Removed { blocks: ids });
                    }
                }
            })
        })
        .collect();
    let reader = reader(&index, &done, &hashes.sequence, move |scores| {
        assert!(scores.workers.iter().all(|o| o.depth <= full));
    });
    for writer in writers {
        writer.join().expect("writer panicked");
    }
    done.store(true, Ordering::Release);
    assert!(reader.join().expect("reader panicked") > 0);
    let stats = index.stats();
    assert_eq!(
        (
            stats.distinct_blocks,
            stats.worker_blocks,
            stats.orphan_blocks
        ),
        (0, 0, 0),
        "both writers dropped everything they stored"
    );
    // What is left behind still counts exactly: both store the chain, the first drops it.
    let (first, second) = (WorkerKey::new(0, 0), WorkerKey::new(1, 0));
    for worker in [first, second] {
        index.apply(worker, &KvEvent::stored(None, blocks.iter().copied()));
    }
    let ids = blocks.iter().map(|b| b.0).collect();
    let removed = index.apply(first, &KvEvent::Removed { blocks: ids });
    assert_eq!(removed.blocks_removed, u64::from(full));
    let scores = index.find_matches(&hashes.sequence);
    assert_eq!((scores.workers.len(), scores.depth(second)), (1, full));
    let stats = index.stats();
    assert_eq!(
        (
            stats.distinct_blocks,
            stats.worker_blocks,
            stats.orphan_blocks
        ),
        (hashes.len(), u64::from(full), 0)
    );
}

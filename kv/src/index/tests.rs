use super::*;
use crate::event::{BlockParent, StoredBlock};
use crate::hash::{ExternalHash, LocalBlockHash, extend_sequence_hashes};

const W1: WorkerKey = WorkerKey::new(1, 0);
const W2: WorkerKey = WorkerKey::new(2, 0);

/// Sequence hashes of a chain of local hashes.
fn chain(locals: &[u64]) -> Vec<SequenceHash> {
    let locals: Vec<LocalBlockHash> = locals.iter().copied().map(LocalBlockHash).collect();
    let mut out = Vec::new();
    extend_sequence_hashes(None, &locals, &mut out);
    out
}

/// Engine ids: the local hash plus a per-worker offset, so workers differ.
fn ext(worker: WorkerKey, local: u64) -> ExternalHash {
    ExternalHash(local + worker.instance_id * 1_000_000)
}

/// Stores `locals[from..to]` of the chain `locals` for `worker` (parent = block `from - 1`).
fn store(
    index: &KvIndex,
    worker: WorkerKey,
    locals: &[u64],
    from: usize,
    to: usize,
) -> ApplyOutcome {
    let seqs = chain(locals);
    let parent = from.checked_sub(1).map(|p| BlockParent {
        external: ext(worker, locals[p]),
        sequence: seqs[p],
    });
    let event = KvEvent::stored(
        parent,
        locals[from..to]
            .iter()
            .map(|&l| (ext(worker, l), LocalBlockHash(l))),
    );
    index.apply(worker, &event)
}

fn remove(index: &KvIndex, worker: WorkerKey, locals: &[u64]) -> ApplyOutcome {
    let blocks = locals.iter().map(|&l| ext(worker, l)).collect();
    index.apply(worker, &KvEvent::Removed { blocks })
}

const DOC: [u64; 6] = [10, 11, 12, 13, 14, 15];

#[test]
fn stored_chain_matches_its_prefixes() {
    for shards in [1, 64] {
        let index = KvIndex::with_shards(shards);
        let outcome = store(&index, W1, &DOC, 0, 4);
        assert_eq!(outcome.blocks_stored, 4);
        assert_eq!(outcome.status(), crate::ApplyStatus::Ok);
        let query = chain(&DOC);
        let scores = index.find_matches(&query);
        assert_eq!(scores.depth(W1), 4);
        assert_eq!(scores.workers[0].cached_blocks, 4);
        assert_eq!(index.find_matches(&query[..2]).depth(W1), 2);
        assert!(index.find_matches(&chain(&[11, 12])).is_empty());
        assert!(index.find_matches(&[]).is_empty());
    }
}

#[test]
fn workers_score_their_own_depths() {
    let index = KvIndex::new();
    store(&index, W1, &DOC, 0, 2);
    store(&index, W2, &DOC, 0, 5);
    let other = WorkerKey::new(3, 0);
    store(&index, other, &[10, 99], 0, 2);
    let scores = index.find_matches(&chain(&DOC));
    assert_eq!(scores.depth(W1), 2);
    assert_eq!(scores.depth(W2), 5);
    assert_eq!(scores.depth(other), 1);
    assert_eq!(scores.max_depth(), 5);
    assert_eq!(index.cached_blocks(), vec![(W1, 2), (W2, 5), (other, 2)]);
}

#[test]
fn removal_does_not_cascade_and_a_restored_parent_reconnects() {
    let index = KvIndex::new();
    store(&index, W1, &DOC, 0, 6);
    let outcome = remove(&index, W1, &[12]);
    assert_eq!(outcome.blocks_removed, 1);
    let query = chain(&DOC);
    let scores = index.find_matches(&query);
    assert_eq!(scores.depth(W1), 2, "the match stops at the hole");
    assert_eq!(
        scores.workers[0].cached_blocks, 5,
        "descendants stay cached"
    );
    assert_eq!(index.stats().orphan_blocks, 1);
    store(&index, W1, &DOC, 2, 3);
    assert_eq!(index.find_matches(&query).depth(W1), 6);
    assert_eq!(index.stats().orphan_blocks, 0);
}

#[test]
fn unknown_parent_attaches_the_blocks_as_orphans() {
    let index = KvIndex::new();
    let outcome = store(&index, W1, &DOC, 3, 6);
    assert_eq!(outcome.parent_not_found, 1);
    assert_eq!(outcome.blocks_stored, 3);
    assert!(outcome.suggests_resync());
    let query = chain(&DOC);
    assert_eq!(index.find_matches(&query).depth(W1), 0);
    assert_eq!(index.stats().orphan_blocks, 1);
    // The missing prefix arrives (e.g. from a resync): the whole chain matches.
    let outcome = store(&index, W1, &DOC, 0, 3);
    assert_eq!(outcome.status(), crate::ApplyStatus::Ok);
    assert_eq!(index.find_matches(&query).depth(W1), 6);
    assert_eq!(index.stats().orphan_blocks, 0);
}

#[test]
fn a_child_may_list_more_workers_than_its_parent() {
    let index = KvIndex::new();
    store(&index, W1, &DOC, 0, 4);
    store(&index, W2, &DOC, 0, 4);
    remove(&index, W2, &[11]);
    let scores = index.find_matches(&chain(&DOC));
    assert_eq!(scores.depth(W1), 4);
    assert_eq!(scores.depth(W2), 1);
}

#[test]
fn invalid_block_rejects_the_rest_of_its_chain() {
    let index = KvIndex::new();
    let seqs = chain(&DOC);
    let mut blocks: Vec<StoredBlock> = DOC[..4]
        .iter()
        .zip(&seqs)
        .map(|(&l, &s)| StoredBlock {
            external: ext(W1, l),
            local: LocalBlockHash(l),
            sequence: s,
        })
        .collect();
    blocks[2].sequence = SequenceHash(12345);
    let outcome = index.apply(
        W1,
        &KvEvent::Stored {
            parent: None,
            blocks,
        },
    );
    assert_eq!(outcome.blocks_stored, 2);
    assert_eq!(outcome.blocks_invalid, 2);
    assert_eq!(outcome.status(), crate::ApplyStatus::Invalid);
    assert_eq!(index.find_matches(&seqs).depth(W1), 2);
}

#[test]
fn removed_unknown_blocks_are_counted() {
    let index = KvIndex::new();
    assert_eq!(remove(&index, W1, &[1, 2]).blocks_not_found, 2);
    store(&index, W1, &DOC, 0, 2);
    let outcome = remove(&index, W1, &[10, 10]);
    assert_eq!(outcome.blocks_removed, 1);
    assert_eq!(outcome.blocks_not_found, 1);
    assert_eq!(outcome.status(), crate::ApplyStatus::BlockNotFound);
}

#[test]
fn cleared_drops_every_rank_of_the_instance() {
    let index = KvIndex::new();
    let rank1 = WorkerKey::new(1, 1);
    store(&index, W1, &DOC, 0, 3);
    store(&index, rank1, &DOC, 0, 2);
    store(&index, W2, &DOC, 0, 1);
    let outcome = index.apply(rank1, &KvEvent::Cleared);
    assert_eq!(outcome.blocks_cleared, 5);
    let scores = index.find_matches(&chain(&DOC));
    assert_eq!(scores.workers.len(), 1);
    assert_eq!(scores.depth(W2), 1);
    assert_eq!(
        index.workers(),
        vec![W1, rank1, W2],
        "ranks stay registered"
    );
    assert_eq!(index.stats().worker_blocks, 1);
    // The ranks keep working after a clear.
    store(&index, W1, &DOC, 0, 2);
    assert_eq!(index.find_matches(&chain(&DOC)).depth(W1), 2);
}

#[test]
fn removed_workers_free_their_slot_without_leaking_blocks() {
    let index = KvIndex::new();
    let rank1 = WorkerKey::new(1, 1);
    store(&index, W1, &DOC, 0, 3);
    store(&index, rank1, &DOC, 0, 3);
    assert_eq!(index.remove_worker(1).blocks_cleared, 6);
    assert!(index.workers().is_empty());
    assert_eq!(index.stats(), IndexStats::default());
    // A new worker takes over a freed slot and sees none of the old blocks.
    store(&index, W2, &DOC, 0, 1);
    let scores = index.find_matches(&chain(&DOC));
    assert_eq!(scores.workers.len(), 1);
    assert_eq!(scores.depth(W2), 1);
    assert_eq!(index.remove_worker_dp_rank(W1), ApplyOutcome::default());
}

#[test]
fn a_detached_worker_is_gone_at_once_and_its_blocks_when_released() {
    let index = KvIndex::new();
    store(&index, W1, &DOC, 0, 3);
    store(&index, W2, &DOC, 0, 1);
    let detached = index.detach_worker(1);
    assert!(!detached.is_empty());
    // Lookups and totals no longer see it; its blocks are still in the table.
    let scores = index.find_matches(&chain(&DOC));
    assert_eq!(scores.workers.len(), 1);
    assert_eq!(scores.depth(W2), 1);
    let stats = index.stats();
    assert_eq!((stats.workers, stats.worker_blocks), (1, 1));
    assert_eq!(stats.distinct_blocks, 3);
    // Its events register it anew, in another slot, before the old one is released.
    store(&index, W1, &DOC, 0, 2);
    assert_eq!(index.find_matches(&chain(&DOC)).depth(W1), 2);
    assert_eq!(index.release_detached(detached).blocks_cleared, 3);
    assert_eq!(index.find_matches(&chain(&DOC)).depth(W1), 2);
    let stats = index.stats();
    assert_eq!((stats.workers, stats.worker_blocks), (2, 3));
    assert_eq!(stats.distinct_blocks, 2);
    assert!(index.detach_worker(7).is_empty());
}

#[test]
fn an_engine_id_stored_again_moves_to_the_new_block() {
    let index = KvIndex::new();
    store(&index, W1, &DOC, 0, 2);
    let seqs = chain(&DOC);
    // The engine reuses id ext(W1, 11) for another root block.
    let event = KvEvent::stored(None, [(ext(W1, 11), LocalBlockHash(500))]);
    assert_eq!(index.apply(W1, &event).blocks_stored, 1);
    assert_eq!(index.find_matches(&seqs).depth(W1), 1);
    assert_eq!(index.find_matches(&chain(&[500])).depth(W1), 1);
    assert_eq!(remove(&index, W1, &[11]).blocks_removed, 1);
    assert!(index.find_matches(&chain(&[500])).is_empty());
    assert_eq!(index.stats().worker_blocks, 1);
}

#[test]
fn two_engine_ids_for_one_block_hold_it_until_both_go() {
    let index = KvIndex::new();
    let first = KvEvent::stored(None, [(ExternalHash(1), LocalBlockHash(7))]);
    let second = KvEvent::stored(None, [(ExternalHash(2), LocalBlockHash(7))]);
    index.apply(W1, &first);
    index.apply(W1, &second);
    let query = chain(&[7]);
    assert_eq!(index.stats().worker_blocks, 1);
    index.apply(
        W1,
        &KvEvent::Removed {
            blocks: vec![ExternalHash(1)],
        },
    );
    assert_eq!(index.find_matches(&query).depth(W1), 1);
    index.apply(
        W1,
        &KvEvent::Removed {
            blocks: vec![ExternalHash(2)],
        },
    );
    assert!(index.find_matches(&query).is_empty());
}

#[test]
fn many_workers_with_many_depths() {
    let index = KvIndex::new();
    let doc: Vec<u64> = (100..400).collect();
    let query = chain(&doc);
    for w in 0..130u64 {
        let worker = WorkerKey::new(w, 0);
        let depth = (w as usize * 7) % doc.len();
        store(&index, worker, &doc, 0, depth);
    }
    let scores = index.find_matches(&query);
    for w in 0..130u64 {
        let depth = (w as usize * 7) % doc.len();
        assert_eq!(
            scores.depth(WorkerKey::new(w, 0)),
            depth as u32,
            "worker {w}"
        );
    }
}

#[test]
fn a_block_recorded_under_another_parent_is_rejected() {
    let index = KvIndex::new();
    store(&index, W1, &DOC, 0, 2);
    let seqs = chain(&DOC);
    // A root block's sequence hash is its local hash, so this root collides with block 1.
    let colliding = KvEvent::stored(
        None,
        [
            (ExternalHash(1), LocalBlockHash(seqs[1].0)),
            (ExternalHash(2), LocalBlockHash(5)),
        ],
    );
    let outcome = index.apply(W2, &colliding);
    assert_eq!(outcome.blocks_invalid, 2);
    assert_eq!(outcome.blocks_stored, 0);
    let stats = index.stats();
    assert_eq!((stats.worker_blocks, stats.orphan_blocks), (2, 0));
    assert_eq!(index.find_matches(&[seqs[1]]).depth(W2), 0);
    assert_eq!(
        index
            .apply(
                W2,
                &KvEvent::Removed {
                    blocks: vec![ExternalHash(1)]
                }
            )
            .blocks_not_found,
        1,
        "the rejected block left no engine id behind"
    );
}

#[test]
fn counts_past_16_bits_stay_exact() {
    // 70,000 children of one root, then 70,000 engine ids for that root: both counts overflow
    // the packed 16-bit form.
    let index = KvIndex::with_shards(4);
    let root = chain(&[1])[0];
    let parent = Some(BlockParent {
        external: ExternalHash(1),
        sequence: root,
    });
    index.apply(
        W1,
        &KvEvent::stored(None, [(ExternalHash(1), LocalBlockHash(1))]),
    );
    let n = 70_000u64;
    let children = KvEvent::Stored {
        parent,
        blocks: Vec::new(),
    };
    assert_eq!(index.apply(W1, &children).blocks_stored, 0);
    for c in 0..n {
        let event = KvEvent::stored(parent, [(ExternalHash(10 + c), LocalBlockHash(10 + c))]);
        assert_eq!(index.apply(W1, &event).status(), crate::ApplyStatus::Ok);
    }
    for id in 0..n {
        let event = KvEvent::stored(None, [(ExternalHash(1_000_000 + id), LocalBlockHash(1))]);
        index.apply(W1, &event);
    }
    let stats = index.stats();
    assert_eq!((stats.worker_blocks, stats.orphan_blocks), (n + 1, 0));
    // Every engine id but the last one of the root goes: it stays held.
    let ids: Vec<ExternalHash> = (0..n).map(|id| ExternalHash(1_000_000 + id)).collect();
    let removed = index.apply(W1, &KvEvent::Removed { blocks: ids });
    assert_eq!(removed.blocks_removed, n);
    assert_eq!(index.stats().orphan_blocks, 0);
    let removed = index.apply(
        W1,
        &KvEvent::Removed {
            blocks: vec![ExternalHash(1)],
        },
    );
    assert_eq!(removed.blocks_removed, 1);
    let stats = index.stats();
    assert_eq!((stats.worker_blocks, stats.orphan_blocks), (n, n));
    // The root comes back: every child is matchable again.
    index.apply(
        W1,
        &KvEvent::stored(None, [(ExternalHash(1), LocalBlockHash(1))]),
    );
    assert_eq!(index.stats().orphan_blocks, 0);
    let child = chain(&[1, 10 + n - 1]);
    assert_eq!(index.find_matches(&child).depth(W1), 2);
    let ids: Vec<ExternalHash> = (0..n).map(|c| ExternalHash(10 + c)).collect();
    assert_eq!(
        index
            .apply(W1, &KvEvent::Removed { blocks: ids })
            .blocks_removed,
        n
    );
    let stats = index.stats();
    assert_eq!(
        (
            stats.distinct_blocks,
            stats.worker_blocks,
            stats.orphan_blocks
        ),
        (1, 1, 0)
    );
}

/// An index bounded to `max` (worker, block) pairs.
fn bounded(max: u64) -> KvIndex {
    KvIndex::with_limits(IndexLimits {
        max_blocks: Some(max),
    })
}

#[test]
fn eviction_keeps_the_bound_and_counts_exactly() {
    let index = bounded(4);
    let doc: Vec<u64> = (100..106).collect();
    let query = chain(&doc);
    assert_eq!(store(&index, W1, &doc, 0, 4).blocks_stored, 4);
    assert_eq!(index.stats().evicted_blocks, 0);
    // Two more blocks: the oldest event loses its two deepest blocks (3, then 2).
    assert_eq!(store(&index, W1, &doc, 4, 6).blocks_stored, 2);
    let stats = index.stats();
    assert_eq!(stats.evicted_blocks, 2);
    assert_eq!(stats.worker_blocks, 4);
    assert_eq!(stats.distinct_blocks, 4);
    // Blocks 0, 1, 4, 5 are held: block 4 lost its parent 3 and is an orphan.
    assert_eq!(stats.orphan_blocks, 1);
    assert_eq!(index.find_matches(&query).depth(W1), 2);
    assert_eq!(index.find_matches(&query[4..]).depth(W1), 2);
    // A later Removed of an evicted block is an unknown block.
    let outcome = remove(&index, W1, &doc[3..4]);
    assert_eq!((outcome.blocks_removed, outcome.blocks_not_found), (0, 1));
    // Storing 2 and 3 again evicts what is oldest now: 1, then 0.
    store(&index, W1, &doc, 2, 4);
    let stats = index.stats();
    assert_eq!((stats.evicted_blocks, stats.worker_blocks), (4, 4));
    assert_eq!(stats.orphan_blocks, 1, "block 2 lost its parent 1");
    assert_eq!(index.find_matches(&query).depth(W1), 0);
    assert_eq!(index.find_matches(&query[2..]).depth(W1), 4);
}

#[test]
fn over_capacity_workers_lose_blocks_first() {
    let index = bounded(6);
    let doc1: Vec<u64> = (10..14).collect();
    let doc2: Vec<u64> = (20..24).collect();
    index.set_worker_capacity(W2, 2);
    // W2 stores first (least recently used) but is also over its capacity of 2.
    store(&index, W2, &doc2, 0, 4);
    store(&index, W1, &doc1, 0, 2);
    // Two pairs over the bound: both come from W2, which was over capacity by 2.
    store(&index, W1, &doc1, 2, 4);
    let counts = index.cached_blocks();
    assert_eq!(counts, vec![(W1, 4), (W2, 2)]);
    assert_eq!(index.stats().evicted_blocks, 2);
    // W2 is at its capacity now; the next eviction takes the least recently used worker,
    // W2 again (it stored before W1), and not W1's blocks.
    let doc3: Vec<u64> = (30..31).collect();
    store(&index, W1, &doc3, 0, 1);
    assert_eq!(index.cached_blocks(), vec![(W1, 5), (W2, 1)]);
}

#[test]
fn lookups_refresh_recency() {
    let w3 = WorkerKey::new(3, 0);
    let index = bounded(6);
    let doc1: Vec<u64> = (10..12).collect();
    let doc2: Vec<u64> = (20..22).collect();
    let doc3: Vec<u64> = (30..32).collect();
    store(&index, W1, &doc1, 0, 2);
    store(&index, W2, &doc2, 0, 2);
    store(&index, w3, &doc3, 0, 2);
    // W1 stored first, but a lookup just matched it: W2 is now the least recently used.
    assert_eq!(index.find_matches(&chain(&doc1)).depth(W1), 2);
    store(&index, w3, &[40], 0, 1);
    assert_eq!(index.cached_blocks(), vec![(W1, 2), (W2, 1), (w3, 3)]);
    assert_eq!(index.stats().evicted_blocks, 1);
}

#[test]
fn eviction_per_apply_is_proportional_to_the_event() {
    let index = bounded(100);
    let doc: Vec<u64> = (1000..1200).collect();
    // One 200-block event evicts its own 100 deepest blocks (within 2 × 200), no more, and
    // leaves a prefix without orphans.
    store(&index, W2, &doc, 0, 200);
    let stats = index.stats();
    assert_eq!((stats.worker_blocks, stats.evicted_blocks), (100, 100));
    assert_eq!(stats.orphan_blocks, 0);
    assert_eq!(index.find_matches(&chain(&doc)).depth(W2), 100);
    // Each one-block event of another worker then evicts exactly one of W2's, deepest first.
    let doc1: Vec<u64> = (1..20).collect();
    for i in 0..10 {
        store(&index, W1, &doc1, i, i + 1);
        assert_eq!(index.stats().evicted_blocks, 100 + i as u64 + 1);
    }
    assert_eq!(index.cached_blocks(), vec![(W1, 10), (W2, 90)]);
    assert_eq!(index.find_matches(&chain(&doc1)).depth(W1), 10);
    assert_eq!(index.find_matches(&chain(&doc)).depth(W2), 90);
    assert_eq!(index.stats().orphan_blocks, 0);
}

#[test]
fn unbounded_index_keeps_everything() {
    let index = KvIndex::new();
    assert_eq!(index.limits(), IndexLimits::default());
    index.set_worker_capacity(W1, 1);
    store(&index, W1, &DOC, 0, 6);
    let stats = index.stats();
    assert_eq!((stats.worker_blocks, stats.evicted_blocks), (6, 0));
}

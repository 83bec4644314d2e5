//! [`KvIndex::heap_bytes`] against the bytes a counting global allocator sees the index hold:
//! own ids and engine ids, blocks held by one worker, by a few and by more than 64 (bitset
//! holder sets), a bounded index that evicts (its store-order queues), and after removals.
//!
//! One test function: other tests' allocations in the same process would be counted too.

#[path = "../benches/counting/mod.rs"]
mod counting;

use kvmesh_kv::{
    ExternalHash, IndexLimits, KvEvent, KvIndex, LocalBlockHash, WorkerKey, sequence_hash,
};

use counting::{Counting, live};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Chain `chain` (100 blocks, the first 20 shared by every chain), as a Stored event whose
/// blocks are named by their own sequence hash or, with `engine_ids`, by other ids.
fn chain(chain: u64, engine_ids: bool) -> KvEvent {
    let mut previous = None;
    let blocks = (0..100u64).map(|i| {
        let local = LocalBlockHash(if i < 20 { i + 1 } else { chain << 20 | i });
        let sequence = sequence_hash(previous, local);
        previous = Some(sequence);
        let external = if engine_ids {
            ExternalHash(chain << 32 | i)
        } else {
            ExternalHash::own(sequence)
        };
        (external, local, sequence)
    });
    KvEvent::Stored {
        parent: None,
        blocks: blocks
            .map(|(external, local, sequence)| kvmesh_kv::StoredBlock {
                external,
                local,
                sequence,
            })
            .collect(),
    }
}

/// Fills `index` from `workers` workers, 12 chains each over 60 distinct chains (so blocks
/// are held by one worker, by several, and the shared prefix by every worker), then removes
/// every third chain's blocks; returns what the allocator counted against what the index
/// reports.
fn measure(limits: IndexLimits, workers: u64, engine_ids: bool) -> (isize, usize) {
    let before = live();
    let index = Box::new(KvIndex::with_limits(limits));
    for w in 0..workers {
        let worker = WorkerKey::new(w, 0);
        for c in 0..12 {
            index.apply(worker, &chain((w * 7 + c) % 60, engine_ids));
        }
        for c in (0..12).step_by(3) {
            let KvEvent::Stored { blocks, .. } = chain((w * 7 + c) % 60, engine_ids) else {
                unreachable!("a Stored event");
            };
            let removed = blocks.iter().map(|b| b.external).collect();
            index.apply(worker, &KvEvent::Removed { blocks: removed });
        }
    }
    let counted = live() - before - std::mem::size_of::<KvIndex>() as isize;
    (counted, index.heap_bytes())
}

#[test]
fn heap_bytes_is_what_the_allocator_counts() {
    let unbounded = IndexLimits::default();
    let bounded = IndexLimits {
        max_blocks: Some(30_000),
    };
    let cases = [
        ("one worker, own ids", unbounded, 1, false),
        ("one worker, engine ids", unbounded, 1, true),
        ("100 workers, own ids", unbounded, 100, false),
        ("100 workers, engine ids", unbounded, 100, true),
        ("100 workers, bounded", bounded, 100, false),
    ];
    let mut reports = Vec::new();
    for (name, limits, workers, engine_ids) in cases {
        let (counted, reported) = measure(limits, workers, engine_ids);
        reports.push((name, counted, reported));
    }
    for (name, counted, reported) in &reports {
        eprintln!("{name}: heap_bytes() {reported}, counted {counted}");
        let ratio = *reported as f64 / *counted as f64;
        assert!(
            (0.995..=1.005).contains(&ratio),
            "{name}: heap_bytes() {reported} against {counted} counted"
        );
    }
    // Engine ids cost their table.
    assert!(
        reports[3].2 > reports[2].2 + reports[2].2 / 2,
        "{reports:?}"
    );
}

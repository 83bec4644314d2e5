//! Heap bytes per cached block, counted by a global allocator wrapper.
//!
//! Run with `cargo bench -p kvmesh-kv --bench memory`.

#[allow(
    dead_code,
    reason = "shared by several bench binaries; each uses a subset"
)]
mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use kvmesh_kv::{
    ApproxConfig, ApproxIndex, BlockHashes, KvIndex, WorkerKey, extend_sequence_hashes,
};

use common::{populate, sequence_locals};

/// The system allocator, keeping a count of live heap bytes.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so the
// `GlobalAlloc` contract is `System`'s; the counter has no effect on the allocations.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded from our caller, who upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded from our caller, who upholds `dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: forwarded from our caller, who upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

fn events_index(workers: u64, total: usize) {
    let before = live();
    let index = KvIndex::new();
    populate(&index, workers, total);
    let bytes = (live() - before) as f64;
    let stats = index.stats();
    println!(
        "KvIndex    {workers:>3} workers: {:>8} distinct blocks, {:>8} (worker, block) pairs, {:>6.1} MiB: {:>6.1} B/distinct block, {:>6.1} B/pair",
        stats.distinct_blocks,
        stats.worker_blocks,
        bytes / (1 << 20) as f64,
        bytes / stats.distinct_blocks as f64,
        bytes / stats.worker_blocks as f64,
    );
}

fn approx_index(workers: u64, total: usize) {
    let before = live();
    let config = ApproxConfig {
        ttl: Duration::from_secs(120),
        max_blocks: total * 2,
        ..ApproxConfig::default()
    };
    let index = ApproxIndex::new(config).expect("valid config");
    let now = Instant::now();
    let per_worker = total / workers as usize / common::SEQUENCE_BLOCKS;
    let mut hashes = BlockHashes::default();
    for w in 0..workers {
        for s in 0..per_worker as u64 {
            let id = w * per_worker as u64 + s;
            hashes.local = sequence_locals((w + s) % common::PROMPTS, id, common::SEQUENCE_BLOCKS);
            hashes.sequence.clear();
            extend_sequence_hashes(None, &hashes.local, &mut hashes.sequence);
            index.record(WorkerKey::new(w, 0), &hashes, now);
        }
    }
    drop(hashes);
    let bytes = (live() - before) as f64;
    let predicted = index.stats().predicted_blocks;
    println!(
        "ApproxIndex {workers:>2} workers: {predicted:>8} predicted pairs, {:>6.1} MiB: {:>6.1} B/pair (predictions + inner index)",
        bytes / (1 << 20) as f64,
        bytes / predicted as f64,
    );
}

fn main() {
    for workers in [1, 8, 64, 256] {
        events_index(workers, 1 << 20);
    }
    // Hash tables grow by doubling, so bytes per block depend on how full they happen to be.
    for total in [1 << 19, 3 << 18, 3 << 19] {
        events_index(64, total);
    }
    approx_index(64, 1 << 20);
}

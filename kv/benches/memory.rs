//! Heap bytes per cached block, counted by a global allocator wrapper.
//!
//! Run with `cargo bench -p kvmesh-kv --bench memory`. With `KVMESH_MEMORY_BLOCKS=N` it builds
//! one index of about N (worker, block) pairs over `KVMESH_MEMORY_WORKERS` workers (default
//! 1,024) instead, and also reports the apply rate while filling it and single-call
//! `find_matches` percentiles over `KVMESH_MEMORY_LOOKUPS` calls (default 20,000) on it (check
//! free memory first: the index takes about 35 bytes per block). `KVMESH_MEMORY_MAX_BLOCKS=M`
//! bounds that index to M pairs ([`IndexLimits`]), so filling it evicts. Counting instructions
//! (`perf stat -e instructions:u`) with two lookup counts gives instructions per lookup,
//! independent of the machine's load.

#[allow(
    dead_code,
    reason = "shared by several bench binaries; each uses a subset"
)]
mod common;
mod counting;

use std::time::{Duration, Instant};

use kvmesh_kv::{
    ApproxConfig, ApproxIndex, BlockHashes, IndexLimits, KvIndex, WorkerKey, extend_sequence_hashes,
};

use common::{PROMPTS, SEQUENCE_BLOCKS, mix, populate, sequence_locals, stored_chain};
use counting::{Counting, live};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn events_index(workers: u64, total: usize) {
    let before = live();
    let index = KvIndex::new();
    populate(&index, workers, total);
    let bytes = (live() - before) as f64;
    let stats = index.stats();
    println!(
        "KvIndex    {workers:>3} workers: {:>8} distinct blocks, {:>8} (worker, block) pairs, {:>6.1} MiB: {:>6.1} B/distinct block, {:>6.1} B/pair ({:.3} of it in heap_bytes())",
        stats.distinct_blocks,
        stats.worker_blocks,
        bytes / (1 << 20) as f64,
        bytes / stats.distinct_blocks as f64,
        bytes / stats.worker_blocks as f64,
        index.heap_bytes() as f64 / bytes,
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

/// The `KVMESH_MEMORY_BLOCKS` run: one large index, its build rate, lookup latency and the
/// time to remove a worker.
fn large_index(total: usize) {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let workers = env("KVMESH_MEMORY_WORKERS", 1024);
    let lookups = env("KVMESH_MEMORY_LOOKUPS", 20_000).max(1);
    let max_blocks = std::env::var("KVMESH_MEMORY_MAX_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok());
    let before = live();
    let index = KvIndex::with_limits(IndexLimits { max_blocks });
    let start = Instant::now();
    let query = populate(&index, workers, total);
    let elapsed = start.elapsed();
    let bytes = (live() - before) as f64;
    let stats = index.stats();
    println!(
        "KvIndex {workers} workers, bound {max_blocks:?}: {} distinct blocks, {} (worker, block) pairs ({} evicted, {} orphans), {:.2} GiB: {:.1} B/distinct block, {:.1} B/pair",
        stats.distinct_blocks,
        stats.worker_blocks,
        stats.evicted_blocks,
        stats.orphan_blocks,
        bytes / (1u64 << 30) as f64,
        bytes / stats.distinct_blocks as f64,
        bytes / stats.worker_blocks as f64,
    );
    println!(
        "built in {:.1} s: {:.2}M block-events/s (Stored, 512 blocks per event, one thread)",
        elapsed.as_secs_f64(),
        (stats.worker_blocks + stats.evicted_blocks) as f64 / elapsed.as_secs_f64() / 1e6,
    );
    // Single-apply latency once full: 1,000 more 512-block events of new sequences, spread over
    // the workers (with a bound, each evicts as much as it stores).
    let mut applies: Vec<Duration> = (0..1_000u64)
        .map(|i| {
            let locals = sequence_locals(i % PROMPTS, 1 << 40 | i, SEQUENCE_BLOCKS);
            let event = stored_chain(None, &locals).0;
            let worker = WorkerKey::new(mix(i) % workers, 0);
            let start = Instant::now();
            index.apply(worker, &event);
            start.elapsed()
        })
        .collect();
    applies.sort_unstable();
    println!(
        "apply once full, 512-block Stored: p50 {:.2?} p99 {:.2?} max {:.2?} ({} evicted in all)",
        applies[applies.len() / 2],
        applies[applies.len() * 99 / 100],
        applies[applies.len() - 1],
        index.stats().evicted_blocks,
    );
    let mut latencies: Vec<Duration> = (0..lookups)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(index.find_matches(std::hint::black_box(&query)));
            start.elapsed()
        })
        .collect();
    latencies.sort_unstable();
    let at = |p: f64| latencies[((latencies.len() - 1) as f64 * p).round() as usize];
    println!(
        "find_matches, 512-block query: p50 {:.2?} p99 {:.2?} ({} matching workers)",
        at(0.5),
        at(0.99),
        index.find_matches(&query).workers.len(),
    );
    // Removing a worker (an engine leaving discovery) drops all its blocks: detached at once
    // (what the proxy's event intake waits for), released after (on its blocking pool).
    let removals: Vec<(Duration, Duration, u64)> = (0..3)
        .map(|w| {
            let start = Instant::now();
            let detached = index.detach_worker(w);
            let detach = start.elapsed();
            let start = Instant::now();
            let cleared = index.release_detached(detached).blocks_cleared;
            (detach, start.elapsed(), cleared)
        })
        .collect();
    println!(
        "remove_worker, 3 workers: {removals:.2?} (detach time, release time, blocks cleared)"
    );
}

fn main() {
    if let Some(total) = std::env::var("KVMESH_MEMORY_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        large_index(total);
        return;
    }
    for workers in [1, 8, 64, 256] {
        events_index(workers, 1 << 20);
    }
    // Tables grow by a quarter, so bytes per block depend on how full they happen to be.
    for total in [1 << 19, 3 << 18, 3 << 19] {
        events_index(64, total);
    }
    approx_index(64, 1 << 20);
}

//! Index write rate (block-events/s) and `find_matches` latency at 8 / 64 / 256 workers.

#[allow(
    dead_code,
    reason = "shared by several bench binaries; each uses a subset"
)]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvmesh_kv::KvIndex;

use common::{Churn, populate};

/// (worker, block) pairs in the populated index.
const POPULATED: usize = 1 << 20;

fn apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("apply");
    for (blocks, rounds) in [(1usize, 65_536usize), (32, 4_096), (512, 256)] {
        let index = KvIndex::new();
        populate(&index, 64, POPULATED);
        let churn = Churn::new(&index, 1 << 20, 64, rounds, blocks);
        group.throughput(Throughput::Elements(2 * blocks as u64));
        group.bench_function(
            BenchmarkId::new("store+remove, 1M-block index, blocks/event", blocks),
            |b| {
                let mut r = 0;
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        black_box(churn.apply_round(&index, r));
                        r += 1;
                    }
                    start.elapsed()
                })
            },
        );
    }
    group.finish();
}

fn find_matches(c: &mut Criterion) {
    let mut group = c.benchmark_group("find_matches");
    for workers in [8u64, 64, 256] {
        let index = KvIndex::new();
        let query = populate(&index, workers, POPULATED);
        let scores = index.find_matches(&query);
        assert_eq!(scores.max_depth() as usize, query.len());
        group.bench_with_input(
            BenchmarkId::new("512-block query, 1M blocks, workers", workers),
            &query,
            |b, query| b.iter(|| black_box(index.find_matches(black_box(query)))),
        );
        let miss = {
            let mut q = query.clone();
            q[0].0 ^= 1;
            q
        };
        group.bench_with_input(
            BenchmarkId::new("512-block query, no match, workers", workers),
            &miss,
            |b, query| b.iter(|| black_box(index.find_matches(black_box(query)))),
        );
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = apply, find_matches
}
criterion_main!(benches);

//! Hashing throughput: token ids to local and sequence block hashes.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvmesh_kv::{BlockHasher, BlockHashes};

fn hashing(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..8192u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 150_000)
        .collect();
    let mut group = c.benchmark_group("hash");
    group.throughput(Throughput::Elements(tokens.len() as u64));
    for block_size in [16usize, 64] {
        let mut hasher = BlockHasher::new(block_size, None).expect("block size");
        let mut out = BlockHashes::default();
        group.bench_with_input(
            BenchmarkId::new("local+sequence/8192 tokens", block_size),
            &tokens,
            |b, tokens| {
                b.iter(|| {
                    hasher.hash_into(black_box(tokens), &mut out);
                    black_box(out.sequence.last().copied())
                })
            },
        );
        let mm: Vec<Vec<u64>> = (0..tokens.len() / block_size)
            .map(|i| {
                if i % 4 == 0 {
                    vec![i as u64, 7]
                } else {
                    Vec::new()
                }
            })
            .collect();
        group.bench_with_input(
            BenchmarkId::new("multimodal (1 in 4 blocks)/8192 tokens", block_size),
            &tokens,
            |b, tokens| {
                b.iter(|| {
                    hasher.hash_mm_into(black_box(tokens), &mm, &mut out);
                    black_box(out.sequence.last().copied())
                })
            },
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
    targets = hashing
}
criterion_main!(benches);

//! Agent throughput on one core: engine msgpack batches decoded, translated into kvmesh's hash
//! space, numbered and encoded as the JSON batch published on NATS (`Pipeline::push`, the same
//! code the running agent uses, without the sockets).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvmesh_agent::{EngineKind, Pipeline};

const BLOCK: usize = 16;

/// One vLLM batch (positional events, int hashes): `chains` BlockStored events of `len` new
/// blocks each (ids from `base`), then a BlockRemoved of the previous batch's blocks.
fn engine_batch(base: u64, chains: u64, len: u64, removed_base: Option<u64>) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = rmp::encode::write_array_len(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, 1_789_095_808.83);
    let events = chains + u64::from(removed_base.is_some());
    let _ = rmp::encode::write_array_len(&mut out, events as u32);
    for c in 0..chains {
        let first = base + c * len;
        let _ = rmp::encode::write_array_len(&mut out, 8);
        let _ = rmp::encode::write_str(&mut out, "BlockStored");
        let _ = rmp::encode::write_array_len(&mut out, len as u32);
        for id in first..first + len {
            // Engine hashes look random: spread them over 64 bits.
            let _ = rmp::encode::write_uint(&mut out, id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
        let _ = rmp::encode::write_nil(&mut out);
        let _ = rmp::encode::write_array_len(&mut out, (len as usize * BLOCK) as u32);
        for t in 0..len * BLOCK as u64 {
            let _ = rmp::encode::write_uint(&mut out, (first * 31 + t) % 151_000);
        }
        let _ = rmp::encode::write_uint(&mut out, BLOCK as u64);
        let _ = rmp::encode::write_nil(&mut out);
        let _ = rmp::encode::write_str(&mut out, "GPU");
        let _ = rmp::encode::write_nil(&mut out);
    }
    if let Some(removed) = removed_base {
        let _ = rmp::encode::write_array_len(&mut out, 4);
        let _ = rmp::encode::write_str(&mut out, "BlockRemoved");
        let n = chains * len;
        let _ = rmp::encode::write_array_len(&mut out, n as u32);
        for id in removed..removed + n {
            let _ = rmp::encode::write_uint(&mut out, id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
        let _ = rmp::encode::write_str(&mut out, "GPU");
        let _ = rmp::encode::write_uint(&mut out, 0);
    }
    let _ = rmp::encode::write_uint(&mut out, 0);
    out
}

fn pipeline(c: &mut Criterion) {
    let mut group = c.benchmark_group("agent pipeline");
    // (chains per batch, blocks per chain): prefill-like long chains, and decode-like single
    // blocks (one event per block: the per-event overhead dominates).
    for (chains, len) in [(16u64, 32u64), (256, 1)] {
        let per_batch = chains * len;
        // A cycle of batches, each evicting the previous one's blocks, so the table stays at
        // one batch's size however long the bench runs.
        let cycle = 8u64;
        let batches: Vec<Vec<u8>> = (0..cycle)
            .map(|k| {
                let previous = (k + cycle - 1) % cycle;
                engine_batch(k * per_batch, chains, len, Some(previous * per_batch))
            })
            .collect();
        let bytes: usize = batches.iter().map(Vec::len).sum::<usize>() / batches.len();
        // Elements: stored blocks only (each batch also removes as many).
        group.throughput(Throughput::Elements(per_batch));
        let mut p = Pipeline::new(EngineKind::Vllm, 1, BLOCK).expect("pipeline");
        let mut i = 0usize;
        group.bench_function(
            BenchmarkId::new(
                format!("stored blocks, {chains}x{len} per batch ({bytes} B msgpack)"),
                per_batch,
            ),
            |b| {
                b.iter(|| {
                    let out = p.push(0, black_box(&batches[i % batches.len()]));
                    i += 1;
                    black_box(out.len())
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, pipeline);
criterion_main!(benches);

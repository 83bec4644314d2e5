//! `find_matches` latency percentiles (per call, not per batch) with and without a writer
//! thread applying events at full speed, and the write rate of two parallel writers, for a
//! single-lock table and sharded ones.
//!
//! Plain `main` (no criterion): criterion reports means of batches, this reports the
//! distribution of single calls. Every configuration runs [`RUNS`] times, interleaved, and each
//! statistic is the median over the runs, to damp noise from other processes on small machines.
//! Run with `cargo bench -p kvmesh-kv --bench contention`.

#[allow(
    dead_code,
    reason = "shared by several bench binaries; each uses a subset"
)]
mod common;

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use kvmesh_kv::KvIndex;

use common::{Churn, populate};

const POPULATED: usize = 1 << 20;
const WORKERS: u64 = 64;
const CALLS: usize = 100_000;
const RUNS: usize = 3;
const SHARDS: [usize; 4] = [1, 64, 1024, 4096];

/// Reader latency percentiles of one run, and the writer's rate when one ran.
#[derive(Debug, Clone, Copy, Default)]
struct ReadRun {
    p50: Duration,
    p90: Duration,
    p99: Duration,
    p999: Duration,
    write_rate: f64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[at]
}

fn median<T: Copy + PartialOrd>(mut values: Vec<T>) -> T {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    values[values.len() / 2]
}

fn read_run(
    index: &Arc<KvIndex>,
    query: &[kvmesh_kv::SequenceHash],
    churn: Option<Arc<Churn>>,
) -> ReadRun {
    let stop = Arc::new(AtomicBool::new(false));
    let writer = churn.map(|churn| {
        let index = Arc::clone(index);
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let start = Instant::now();
            let mut events = 0u64;
            let mut r = 0;
            while !stop.load(Ordering::Relaxed) {
                events += churn.apply_round(&index, r);
                r += 1;
            }
            events as f64 / start.elapsed().as_secs_f64()
        })
    });
    for _ in 0..CALLS / 10 {
        black_box(index.find_matches(query));
    }
    let mut latencies = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let start = Instant::now();
        black_box(index.find_matches(black_box(query)));
        latencies.push(start.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    let write_rate = writer.map_or(0.0, |t| t.join().expect("writer thread panicked"));
    latencies.sort_unstable();
    ReadRun {
        p50: percentile(&latencies, 0.5),
        p90: percentile(&latencies, 0.9),
        p99: percentile(&latencies, 0.99),
        p999: percentile(&latencies, 0.999),
        write_rate,
    }
}

/// Two writer threads for disjoint workers (their chains hang off a shared prompt); returns
/// the total rate in block-events/s.
fn parallel_writers(index: &Arc<KvIndex>, churns: &[Arc<Churn>; 2]) -> f64 {
    let rounds = 50_000;
    let threads: Vec<_> = churns
        .iter()
        .map(|churn| {
            let churn = Arc::clone(churn);
            let index = Arc::clone(index);
            thread::spawn(move || {
                let start = Instant::now();
                let events: u64 = (0..rounds).map(|r| churn.apply_round(&index, r)).sum();
                (events, start.elapsed())
            })
        })
        .collect();
    let results: Vec<(u64, Duration)> = threads
        .into_iter()
        .map(|t| t.join().expect("writer thread panicked"))
        .collect();
    let events: u64 = results.iter().map(|r| r.0).sum();
    let slowest = results.iter().map(|r| r.1).max().unwrap_or_default();
    events as f64 / slowest.as_secs_f64()
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is not supported, everything runs.
    let setups: Vec<_> = SHARDS
        .iter()
        .map(|&shards| {
            let index = Arc::new(KvIndex::with_shards(shards));
            let query = populate(&index, WORKERS, POPULATED);
            let churns = [
                Arc::new(Churn::new(&index, 1 << 20, 32, 4_096, 32)),
                Arc::new(Churn::new(&index, 2 << 20, 32, 4_096, 32)),
            ];
            (shards, index, query, churns)
        })
        .collect();
    let mut idle = vec![Vec::new(); SHARDS.len()];
    let mut busy = vec![Vec::new(); SHARDS.len()];
    let mut writers = vec![Vec::new(); SHARDS.len()];
    for _ in 0..RUNS {
        for (i, (_, index, query, churns)) in setups.iter().enumerate() {
            idle[i].push(read_run(index, query, None));
            busy[i].push(read_run(index, query, Some(Arc::clone(&churns[0]))));
            writers[i].push(parallel_writers(index, churns));
        }
    }
    let report = |runs: &[ReadRun]| {
        format!(
            "p50 {:>7.2?} p90 {:>7.2?} p99 {:>7.2?} p99.9 {:>8.2?}",
            median(runs.iter().map(|r| r.p50).collect()),
            median(runs.iter().map(|r| r.p90).collect()),
            median(runs.iter().map(|r| r.p99).collect()),
            median(runs.iter().map(|r| r.p999).collect()),
        )
    };
    println!("find_matches, 512-block query, {WORKERS} workers, 1M blocks; medians of {RUNS} runs");
    for (i, (shards, ..)) in setups.iter().enumerate() {
        println!(
            "shards {shards:>4}, no writer:                   {}",
            report(&idle[i])
        );
        println!(
            "shards {shards:>4}, writer at {:>5.2}M block-ev/s: {}",
            median(busy[i].iter().map(|r| r.write_rate).collect()) / 1e6,
            report(&busy[i])
        );
        println!(
            "shards {shards:>4}, 2 writers, no reader: {:.2}M block-events/s in total",
            median(writers[i].clone()) / 1e6
        );
    }
}

//! Where chat preprocessing (parse, template, tokenize) should run so it never blocks the
//! async reactor: inline on the reactor thread, on tokio's blocking pool (`spawn_blocking`) or
//! on a small dedicated thread pool (as many threads as cores, a FIFO channel). Measures the
//! latency of one request alone and the mean latency of a burst of 16 concurrent requests, on
//! a 2-worker runtime, for prompt sizes from ~40 to ~8k tokens, plus a no-op job (the pure
//! dispatch cost).
//!
//! Needs `scripts/fetch-tokenizer.sh`. Run with `cargo bench -p kvmesh-proxy --bench offload`;
//! the results and the choice they led to are in `docs/BENCHMARKS.md` and the docs of
//! `route/src/prepare/offload.rs`.

mod common;

use std::hint::black_box;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvmesh_preprocess::{ChatRequest, ModelPreprocessor};
use tokio::runtime::Runtime;
use tokio::sync::oneshot;

/// Requests in flight at once in the burst measurement.
const BURST: usize = 16;

/// A chat body: a system prompt, then `turns` user/assistant turns of `words` words each,
/// ending with a user turn.
fn chat_body(seed: u64, system_words: usize, turns: usize, words: usize) -> String {
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": common::prose(seed, system_words)})];
    for turn in 0..turns {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages.push(
            serde_json::json!({"role": role, "content": common::prose(seed + 1 + turn as u64, words)}),
        );
    }
    if turns.is_multiple_of(2) {
        messages
            .push(serde_json::json!({"role": "user", "content": common::prose(seed + 999, words.min(50))}));
    }
    serde_json::json!({"model": "qwen3", "messages": messages}).to_string()
}

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads taking jobs from one FIFO channel.
struct ThreadPool {
    tx: mpsc::Sender<Job>,
}

impl ThreadPool {
    fn new(threads: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..threads {
            let rx = Arc::clone(&rx);
            std::thread::spawn(move || {
                loop {
                    let job = match rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                }
            });
        }
        Self { tx }
    }

    async fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(work());
        });
        self.tx.send(job).expect("pool alive");
        rx.await.expect("job ran")
    }
}

#[derive(Clone, Copy, Debug)]
enum Strategy {
    Inline,
    SpawnBlocking,
    Pool,
}

fn preprocess(model: &ModelPreprocessor, body: &[u8]) -> usize {
    if body.is_empty() {
        return 0;
    }
    let request = ChatRequest::from_slice(body).expect("body parses");
    model.chat_token_ids(&request).expect("preprocess").len()
}

async fn dispatch(
    strategy: Strategy,
    pool: &ThreadPool,
    model: &Arc<ModelPreprocessor>,
    body: &Arc<Vec<u8>>,
) -> usize {
    match strategy {
        Strategy::Inline => preprocess(model, body),
        Strategy::SpawnBlocking => {
            let (model, body) = (Arc::clone(model), Arc::clone(body));
            tokio::task::spawn_blocking(move || preprocess(&model, &body))
                .await
                .expect("blocking task")
        }
        Strategy::Pool => {
            let (model, body) = (Arc::clone(model), Arc::clone(body));
            pool.run(move || preprocess(&model, &body)).await
        }
    }
}

fn offload(c: &mut Criterion) {
    let model = Arc::new(ModelPreprocessor::from_dir(common::tokenizer_dir()).expect("tokenizer"));
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime"),
    );
    let pool = Arc::new(ThreadPool::new(2));
    let sizes = [
        ("noop", Vec::new()),
        ("~40 tokens", chat_body(1, 10, 1, 15).into_bytes()),
        ("~300 tokens", chat_body(2, 60, 3, 50).into_bytes()),
        ("~2k tokens", chat_body(3, 300, 5, 250).into_bytes()),
        ("~8k tokens", chat_body(4, 600, 9, 650).into_bytes()),
    ];
    let mut group = c.benchmark_group("offload");
    for (label, body) in sizes {
        let tokens = preprocess(&model, &body);
        let body = Arc::new(body);
        for strategy in [Strategy::Inline, Strategy::SpawnBlocking, Strategy::Pool] {
            let name = format!("{label} ({tokens} tokens)");
            group.bench_function(
                BenchmarkId::new(format!("alone/{strategy:?}"), &name),
                |b| b.iter_custom(|iters| alone(&runtime, strategy, &pool, &model, &body, iters)),
            );
            group.bench_function(
                BenchmarkId::new(format!("burst{BURST} mean/{strategy:?}"), &name),
                |b| b.iter_custom(|iters| burst(&runtime, strategy, &pool, &model, &body, iters)),
            );
        }
    }
    group.finish();
}

/// Total latency of `iters` requests sent one after another.
fn alone(
    runtime: &Runtime,
    strategy: Strategy,
    pool: &Arc<ThreadPool>,
    model: &Arc<ModelPreprocessor>,
    body: &Arc<Vec<u8>>,
    iters: u64,
) -> Duration {
    let (pool, model, body) = (Arc::clone(pool), Arc::clone(model), Arc::clone(body));
    runtime.block_on(async move {
        tokio::spawn(async move {
            let start = Instant::now();
            for _ in 0..iters {
                black_box(dispatch(strategy, &pool, &model, &body).await);
            }
            start.elapsed()
        })
        .await
        .expect("task")
    })
}

/// Sum over `iters` requests of their latency, sent in bursts of [`BURST`] concurrent requests.
fn burst(
    runtime: &Runtime,
    strategy: Strategy,
    pool: &Arc<ThreadPool>,
    model: &Arc<ModelPreprocessor>,
    body: &Arc<Vec<u8>>,
    iters: u64,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(BURST as u64);
        left -= n;
        let latencies: Vec<Duration> = runtime.block_on(async {
            let start = Instant::now();
            let tasks: Vec<_> = (0..BURST)
                .map(|_| {
                    let (pool, model, body) =
                        (Arc::clone(pool), Arc::clone(model), Arc::clone(body));
                    tokio::spawn(async move {
                        black_box(dispatch(strategy, &pool, &model, &body).await);
                        start.elapsed()
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(BURST);
            for task in tasks {
                out.push(task.await.expect("task"));
            }
            out
        });
        total += latencies.iter().take(n as usize).sum::<Duration>();
    }
    total
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10);
    targets = offload
}
criterion_main!(benches);

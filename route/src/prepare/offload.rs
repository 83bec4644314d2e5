//! Where preprocessing runs, so a long prompt never stalls the async reactor: small bodies
//! inline, the rest on a small dedicated thread pool ([`PreprocessPool`]: one thread per
//! core, one FIFO queue).
//!
//! Measured with `cargo bench -p kvmesh-proxy --bench offload` (release, Qwen3 tokenizer,
//! 2-worker runtime, 2 pool threads, on the shared 2-core VM; full table and command in
//! `docs/BENCHMARKS.md`):
//!
//! | job (parse + template + tokenize) | inline | `spawn_blocking` | dedicated pool |
//! |---|---|---|---|
//! | no-op, alone | 4 ns | 8.1 µs | 7.9 µs |
//! | no-op, mean of a burst of 16 | 7 µs | 95 µs | 15 µs |
//! | 45-token chat (≈ 260 B), alone | 45 µs | 70 µs | 49 µs |
//! | 45-token chat, mean of a burst of 16 | 0.30 ms | 0.81 ms | 0.23 ms |
//! | 2.4k-token chat, alone | 1.54 ms | 1.56 ms | 1.56 ms |
//! | 2.4k-token chat, mean of a burst of 16 | 13.1 ms | 10.9 ms | 7.0 ms |
//! | 9.6k-token chat, mean of a burst of 16 | 27.3 ms | 48.7 ms | 26.9 ms |
//!
//! Alone, both hand-overs cost the same ≈ 8 µs. Under a burst, `spawn_blocking` starts a
//! thread per job and the jobs share the two cores until all finish together, so every
//! request waits for nearly the whole burst; the pool runs them first come, first served,
//! which cuts the mean latency by 35–70 %. Inline is no faster than the pool for real
//! prompts and blocks a reactor thread for the whole tokenization (every other connection on
//! it waits), so it is only used where the job costs a few hand-overs: bodies up to
//! [`INLINE_MAX_BYTES`], whose preprocessing measured ≈ 45 µs (the pool's hop adds ≈ 4 µs).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::prepare::{FallbackReason, InvalidPrompt, Prepared, Preparer, PromptKind};

/// Bodies up to this size are prepared inline: a chat request this small (a few dozen tokens)
/// preprocesses in ≈ 45 µs, a stall short enough for the reactor, and saves the pool's hop.
pub const INLINE_MAX_BYTES: usize = 512;

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads running preprocessing jobs in arrival order. Dropping it lets the
/// threads finish their current job and exit.
#[derive(Debug)]
pub struct PreprocessPool {
    jobs: Mutex<mpsc::Sender<Job>>,
}

impl PreprocessPool {
    /// A pool of `threads` threads (at least one).
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("kvmesh-preprocess-{i}"))
                .spawn(move || work(&rx))?;
        }
        Ok(Self {
            jobs: Mutex::new(tx),
        })
    }

    /// A pool with one thread per available core.
    pub fn per_core() -> std::io::Result<Self> {
        Self::new(std::thread::available_parallelism().map_or(1, usize::from))
    }

    /// Runs `job` on the pool; `None` when it panicked.
    pub async fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(job());
        });
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(job);
        if sent.is_err() {
            return None;
        }
        rx.await.ok()
    }
}

/// A pool thread: takes jobs until the pool is dropped; a panicking job is dropped alone.
fn work(rx: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        let job = rx.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(job) = job else { return };
        if catch_unwind(AssertUnwindSafe(job)).is_err() {
            tracing::warn!("a preprocessing job panicked");
        }
    }
}

/// Prepares `body` (see [`Preparer::prepare`]) inline when it is small or needs no parsing,
/// else on `pool` (inline too when there is none).
pub async fn prepare(
    pool: Option<&PreprocessPool>,
    preparer: &Preparer,
    kind: PromptKind,
    body: &Bytes,
    forward: bool,
) -> Result<Prepared, InvalidPrompt> {
    let parses = kind != PromptKind::Other;
    let Some(pool) = pool.filter(|_| parses && body.len() > INLINE_MAX_BYTES) else {
        return preparer.prepare(kind, body, forward);
    };
    let (preparer, body) = (preparer.clone(), body.clone());
    match pool
        .run(move || preparer.prepare(kind, &body, forward))
        .await
    {
        Some(prepared) => prepared,
        None => {
            tracing::warn!("preprocessing failed; routing without tokens");
            Ok(Prepared::fallback(
                FallbackReason::TokenizeFailed,
                Default::default(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn jobs_run_on_the_pool_threads() {
        let pool = PreprocessPool::new(2).unwrap();
        let name = pool
            .run(|| std::thread::current().name().map(str::to_owned))
            .await;
        assert!(
            name.flatten()
                .is_some_and(|n| n.starts_with("kvmesh-preprocess-"))
        );
    }

    #[tokio::test]
    async fn a_panicking_job_fails_alone() {
        let pool = PreprocessPool::new(1).unwrap();
        let panicked: Option<()> = pool.run(|| panic!("tokenizer bug")).await;
        assert_eq!(panicked, None);
        assert_eq!(pool.run(|| 7).await, Some(7), "the thread survived");
    }

    #[tokio::test]
    async fn large_bodies_are_prepared_on_the_pool() {
        let pool = PreprocessPool::new(1).unwrap();
        let preparer = Preparer::new(None, 4, false);
        let ids: Vec<u32> = (0..400).collect();
        let body = Bytes::from(serde_json::json!({ "prompt": ids }).to_string());
        assert!(body.len() > INLINE_MAX_BYTES);
        let prepared = prepare(Some(&pool), &preparer, PromptKind::Completion, &body, true)
            .await
            .unwrap();
        match prepared.input {
            crate::prepare::RouteInput::Tokens(blocks) => assert_eq!(blocks.tokens, 400),
            other => panic!("{other:?}"),
        }
    }
}

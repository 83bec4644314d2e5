//! Where preprocessing runs, so a long prompt never stalls the async reactor: small bodies
//! inline, the rest on a small dedicated thread pool ([`PreprocessPool`]: per core one thread
//! for short jobs and one, at a lower priority, for long ones; each lane one FIFO queue).
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

/// Bodies of at least this size (≈ 16k tokens and up, a millisecond or more to prepare) are
/// long jobs: they run on the pool's long lane, so a burst of them never queues before a short
/// request.
pub const LONG_MIN_BYTES: usize = 64 * 1024;

/// How much the long lane's threads lower their scheduling priority (`nice`): at 10 a thread
/// weighs about a tenth of a normal one, so the reactor and the short lane preempt it at once
/// and still leave it the cores they do not use.
const LONG_LANE_NICE: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

/// A set of threads running jobs in arrival order from one queue.
#[derive(Debug)]
struct Lane {
    jobs: Mutex<mpsc::Sender<Job>>,
}

impl Lane {
    /// A lane of `threads` threads (at least one) named `name-N`; with `background`, each
    /// thread first lowers its priority ([`LONG_LANE_NICE`]).
    fn new(name: &str, threads: usize, background: bool) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    if background {
                        lower_priority();
                    }
                    work(&rx);
                })?;
        }
        Ok(Self {
            jobs: Mutex::new(tx),
        })
    }

    async fn run<T: Send + 'static>(&self, job: impl FnOnce() -> T + Send + 'static) -> Option<T> {
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

/// Lowers the calling thread's scheduling priority by [`LONG_LANE_NICE`] (on Linux the nice
/// value is a thread's own, and the threads it starts inherit it). Elsewhere, or if refused,
/// the thread keeps its priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `nice` takes an integer and touches no memory of ours.
        let niced = unsafe { libc::nice(LONG_LANE_NICE) };
        if niced == -1 {
            tracing::debug!("the long preprocessing lane keeps its priority");
        }
    }
}

/// Threads running preprocessing jobs in arrival order, in two lanes: short jobs, and long
/// jobs (bodies of [`LONG_MIN_BYTES`] and more) at a lower priority. Dropping it lets the
/// threads finish their current job and exit.
#[derive(Debug)]
pub struct PreprocessPool {
    short: Lane,
    long: Lane,
}

impl PreprocessPool {
    /// A pool of `threads` threads (at least one) per lane.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        Ok(Self {
            short: Lane::new("kvmesh-preprocess", threads, false)?,
            long: Lane::new("kvmesh-preprocess-long", threads, true)?,
        })
    }

    /// A pool with one thread per available core in each lane.
    pub fn per_core() -> std::io::Result<Self> {
        Self::new(std::thread::available_parallelism().map_or(1, usize::from))
    }

    /// Runs `job` on the short lane; `None` when it panicked.
    pub async fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        self.short.run(job).await
    }

    /// Runs `job` on the long lane, at a lower priority; `None` when it panicked.
    pub async fn run_long<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        self.long.run(job).await
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
/// else on `pool`'s short or long lane by its size (inline too when there is none).
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
    let long = body.len() >= LONG_MIN_BYTES;
    let (preparer, body) = (preparer.clone(), body.clone());
    let job = move || preparer.prepare(kind, &body, forward);
    let prepared = if long {
        pool.run_long(job).await
    } else {
        pool.run(job).await
    };
    match prepared {
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
    use std::time::Duration;

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
    async fn a_short_job_does_not_wait_for_a_long_one() {
        let pool = Arc::new(PreprocessPool::new(1).unwrap());
        let (release, held) = std::sync::mpsc::channel::<()>();
        let long = tokio::spawn({
            let pool = Arc::clone(&pool);
            async move {
                pool.run_long(move || {
                    held.recv().unwrap();
                    std::thread::current().name().map(str::to_owned)
                })
                .await
            }
        });
        let short = tokio::time::timeout(Duration::from_secs(10), pool.run(|| 7)).await;
        assert_eq!(short.expect("the short lane answered").unwrap(), 7);
        release.send(()).unwrap();
        let name = long.await.unwrap().flatten().unwrap();
        assert!(name.starts_with("kvmesh-preprocess-long-"), "{name}");
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_long_lane_runs_at_a_lower_priority() {
        let pool = PreprocessPool::new(1).unwrap();
        // SAFETY: `getpriority` takes integers and touches no memory of ours.
        let nice = || unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let (short, long) = (
            pool.run(nice).await.unwrap(),
            pool.run_long(nice).await.unwrap(),
        );
        assert_eq!(long, (short + LONG_LANE_NICE).min(19));
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

//! Continuous batching: one task per engine runs iterations; requests reach it over a channel
//! and get their tokens back over a per-request channel.

mod core;
mod sequence;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc, oneshot};

pub(crate) use self::core::SchedulerCore;
use crate::config::InterferenceScaling;
use crate::kv_events::KvEventBatch;
use crate::kv_transfer::link::Link;
use crate::lora::Lora;
use crate::metrics::{EngineMetrics, Finish};
use crate::timing::TimingModel;

/// If the scheduler falls this far behind its virtual clock it re-anchors on the wall clock
/// instead of catching up with back-to-back iterations.
const MAX_LAG: Duration = Duration::from_millis(20);

/// What a sequence does with KV beyond its own engine (disaggregated serving).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum Handoff {
    /// Nothing: an ordinary request.
    #[default]
    None,
    /// A prefill leg: its blocks stay allocated after it ends, held under this request id
    /// until a decode engine reads them or the hold times out.
    Hold(String),
    /// A decode leg: the KV of this many leading prompt tokens was pulled from a prefill
    /// engine, so only the rest is prefilled here.
    Pulled(usize),
    /// SGLang's decode leg: as [`Handoff::Pulled`] for `tokens`, and the answer reports
    /// `cached` cached prompt tokens, the prefill engine's prefix hit (what SGLang's decode
    /// engine reports: `decode.py` at 0035ca42, `_commit_transfer_to_req`).
    Transferred {
        /// Leading prompt tokens whose KV came from the prefill engine.
        tokens: usize,
        /// The prefill engine's cached prompt tokens.
        cached: usize,
    },
}

/// One prompt submitted for generation.
#[derive(Debug)]
pub(crate) struct SeqRequest {
    /// Choice index within the HTTP request.
    pub index: u32,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Sequence hashes of the prompt's full blocks (in `lora`'s hash space, the first block
    /// salted with `cache_salt`).
    pub prompt_hashes: Vec<u64>,
    /// The LoRA adapter to run with; `None` for the base model.
    pub lora: Option<Lora>,
    /// The request's `cache_salt`: its first block's hashes are salted (see
    /// [`crate::hashing::salted_local_hash`]); `None` for none.
    pub cache_salt: Option<Arc<str>>,
    /// Seed of the generated words.
    pub seed: u64,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Stop strings (non-empty).
    pub stops: Arc<[String]>,
    /// Send a delta per token instead of only the final text.
    pub stream: bool,
    /// When the HTTP request arrived.
    pub arrival: Instant,
    /// Where this sequence's events go.
    pub tx: mpsc::UnboundedSender<SeqEvent>,
    /// Disaggregated serving: what it hands off or received.
    pub handoff: Handoff,
}

/// A finished sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SeqOutcome {
    /// Choice index.
    pub index: u32,
    /// Streaming: the text not yet sent; otherwise the whole generated text.
    pub text: String,
    /// Why it finished.
    pub finish: Finish,
    /// The stop string that matched, if any.
    pub stop: Option<String>,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    /// A prefill leg's blocks, held for a decode engine (empty otherwise).
    pub held_blocks: Vec<u64>,
}

/// What the scheduler sends back for a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SeqEvent {
    /// Streaming only: a generated token's text (may be empty for the first token while a stop
    /// string could still be forming).
    Delta {
        /// Choice index.
        index: u32,
        /// New text.
        text: String,
    },
    /// The sequence finished normally.
    Finished(SeqOutcome),
    /// The sequence cannot run on this engine.
    Failed {
        /// Choice index.
        index: u32,
        /// Why.
        message: String,
    },
}

/// Requests to the scheduler task.
#[derive(Debug)]
pub(crate) enum Command {
    /// Queue the sequences of one request.
    Submit(Vec<SeqRequest>),
    /// A decode engine reads the blocks a prefill leg holds (by its request id, else by the
    /// exact block list); they are freed. Answered with how many there were (`None`: no
    /// such hold, or it expired).
    ReadHeld {
        /// The prefill's request id.
        request_id: Option<String>,
        /// The block ids the answer named.
        block_ids: Vec<u64>,
        /// Answered once freed.
        done: oneshot::Sender<Option<usize>>,
    },
    /// How many leading blocks of a prompt (its sequence hashes) the prefix cache holds.
    CachedPrefix {
        /// The prompt's full blocks' sequence hashes.
        hashes: Vec<u64>,
        /// Answered with the count.
        done: oneshot::Sender<usize>,
    },
    /// Drop every cached block; the sender is answered when done.
    ResetPrefixCache {
        /// Test-only fault: also mark the resulting `AllBlocksCleared` batch as an engine
        /// restart (event sequence numbers start over).
        restart: bool,
        /// Answered once the cache is empty.
        done: oneshot::Sender<()>,
    },
}

/// The scheduler task has stopped (the engine is shutting down).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the engine is shutting down")]
pub(crate) struct SchedulerGone;

/// Cheap, cloneable access to a running scheduler.
#[derive(Debug, Clone)]
pub(crate) struct SchedulerHandle {
    tx: mpsc::UnboundedSender<Command>,
    metrics: Arc<EngineMetrics>,
}

impl SchedulerHandle {
    /// Queues the sequences of one request (counted in flight until they leave the
    /// scheduler).
    pub(crate) fn submit(&self, seqs: Vec<SeqRequest>) -> Result<(), SchedulerGone> {
        // Counted before the scheduler can see them, so it never takes away more than came.
        let count = seqs.len();
        self.metrics.requests_entered(count);
        self.tx.send(Command::Submit(seqs)).map_err(|_| {
            self.metrics.requests_left(count);
            SchedulerGone
        })
    }

    /// Frees the blocks a prefill leg holds, for a decode engine that read them; how many
    /// there were (`None`: nothing held under that id, or it expired).
    pub(crate) async fn read_held(
        &self,
        request_id: Option<String>,
        block_ids: Vec<u64>,
    ) -> Result<Option<usize>, SchedulerGone> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Command::ReadHeld {
                request_id,
                block_ids,
                done,
            })
            .map_err(|_| SchedulerGone)?;
        rx.await.map_err(|_| SchedulerGone)
    }

    /// How many leading blocks of `hashes` the prefix cache holds now (a decode leg reads
    /// only the rest).
    pub(crate) async fn cached_prefix(&self, hashes: Vec<u64>) -> Result<usize, SchedulerGone> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Command::CachedPrefix { hashes, done })
            .map_err(|_| SchedulerGone)?;
        rx.await.map_err(|_| SchedulerGone)
    }

    /// Clears the prefix cache between two iterations; with `restart` the `AllBlocksCleared`
    /// batch also announces a simulated engine restart.
    pub(crate) async fn reset_prefix_cache(&self, restart: bool) -> Result<(), SchedulerGone> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Command::ResetPrefixCache { restart, done })
            .map_err(|_| SchedulerGone)?;
        rx.await.map_err(|_| SchedulerGone)
    }
}

/// How transfers on the engine's inbound link slow its iterations.
#[derive(Debug, Clone)]
pub(crate) struct Interference {
    /// The link.
    pub link: Arc<Link>,
    /// Extra share of an iteration's time while a transfer runs (0.3: 30 % longer).
    pub factor: f64,
    /// Once while any runs, or per transfer in flight.
    pub scaling: InterferenceScaling,
}

impl Interference {
    /// How many times longer an iteration takes with `transfers` in flight.
    pub(crate) fn slowdown(&self, transfers: usize) -> f64 {
        let counted = match self.scaling {
            InterferenceScaling::Any => transfers.min(1),
            InterferenceScaling::PerTransfer => transfers,
        };
        1.0 + self.factor * counted as f64
    }
}

/// Starts the scheduler task; `timing` is `None` in no-delay mode.
pub(crate) fn spawn(
    core: SchedulerCore,
    timing: Option<TimingModel>,
    interference: Interference,
) -> (SchedulerHandle, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let metrics = core.metrics();
    let task = tokio::spawn(run(core, rx, timing, interference));
    (SchedulerHandle { tx, metrics }, task)
}

/// Subscribers of the KV event stream.
pub(crate) type EventSender = broadcast::Sender<Arc<KvEventBatch>>;

async fn run(
    mut core: SchedulerCore,
    mut inbox: mpsc::UnboundedReceiver<Command>,
    timing: Option<TimingModel>,
    interference: Interference,
) {
    // Virtual end of the previous iteration while the engine stays busy: sleeping until
    // `anchor + duration` keeps timer overshoot from accumulating over many iterations.
    let mut anchor: Option<Instant> = None;
    loop {
        core.expire_held(Instant::now());
        if core.is_idle() {
            anchor = None;
            let next = match core.next_hold_deadline() {
                Some(deadline) => {
                    match tokio::time::timeout_at(deadline.into(), inbox.recv()).await {
                        Ok(next) => next,
                        // A hold expired: free it and wait again.
                        Err(_) => continue,
                    }
                }
                None => inbox.recv().await,
            };
            match next {
                Some(cmd) => core.handle(cmd),
                None => return,
            }
        }
        while let Ok(cmd) = inbox.try_recv() {
            core.handle(cmd);
        }
        let plan = core.schedule();
        if plan.batch == 0 {
            core.publish_events();
            if !core.is_idle() {
                tokio::task::yield_now().await;
            }
            continue;
        }
        match timing {
            Some(model) => {
                let now = Instant::now();
                let start = match anchor {
                    Some(a) if now.saturating_duration_since(a) < MAX_LAG => a,
                    _ => now,
                };
                let mut iteration = model.iteration(
                    plan.prefill_tokens,
                    plan.loaded_tokens,
                    plan.usage,
                    plan.batch,
                );
                let transfers = interference.link.active();
                if transfers > 0 {
                    iteration = iteration.mul_f64(interference.slowdown(transfers));
                }
                let deadline = start + iteration;
                tokio::time::sleep_until(deadline.into()).await;
                anchor = Some(deadline);
            }
            None => tokio::task::yield_now().await,
        }
        core.complete(Instant::now());
        core.publish_events();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interference_counts_once_or_per_transfer() {
        let link = Arc::new(Link::new(1.0, false));
        let any = Interference {
            link: link.clone(),
            factor: 0.3,
            scaling: InterferenceScaling::Any,
        };
        assert_eq!(any.slowdown(0), 1.0);
        assert_eq!(any.slowdown(1), 1.3);
        assert_eq!(any.slowdown(4), 1.3);
        let per = Interference {
            scaling: InterferenceScaling::PerTransfer,
            ..any
        };
        assert_eq!(per.slowdown(0), 1.0);
        assert_eq!(per.slowdown(1), 1.3);
        assert!((per.slowdown(4) - 2.2).abs() < 1e-12);
    }
}

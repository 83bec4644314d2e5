//! Approximate mode: for engines without KV events, predict each worker's cache from the
//! proxy's own routing decisions, with a TTL and a size bound.

mod config;
mod outcome;
mod predictions;

use std::ops::Range;
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::Instant;

use crate::error::ApproxConfigError;
use crate::event::{BlockParent, KvEvent, StoredBlock};
use crate::hash::{BlockHashes, ExternalHash, SequenceHash};
use crate::index::{IndexStats, KvIndex};
use crate::scores::OverlapScores;
use crate::worker::WorkerKey;

pub use config::{
    ApproxConfig, DEFAULT_MAX_BLOCKS, DEFAULT_PRUNE_TARGET_RATIO, DEFAULT_TTL, MAX_TTL,
};
pub use outcome::{ApproxOutcome, ApproxStats};
use predictions::{Insert, Predictions};

/// Predictions plus running totals, under one lock.
#[derive(Debug, Default)]
struct State {
    predictions: Predictions,
    totals: ApproxOutcome,
}

/// A [`KvIndex`] fed by routing decisions instead of engine events.
///
/// [`ApproxIndex::record`] predicts that the chosen worker now caches the request's blocks for
/// `ttl`; re-recording a block pushes its expiry back. Expired pairs are removed lazily (a
/// min-heap on expiry), on `record`, `expire` and — when no other thread is busy with the
/// predictions — `find_matches`. Past `max_blocks` pairs, the earliest-expiring ones (deepest
/// first among equal expiries) are pruned down to `prune_target_ratio × max_blocks`. Since a
/// child block never expires later than its parent, the predicted caches stay prefix-closed.
///
/// Time is passed in (`now`), so callers and tests control the clock. Predicted blocks are
/// stored in the inner index with the sequence hash as their engine id.
#[derive(Debug)]
pub struct ApproxIndex {
    index: KvIndex,
    config: ApproxConfig,
    state: Mutex<State>,
}

impl ApproxIndex {
    /// An empty approximate index.
    pub fn new(config: ApproxConfig) -> Result<Self, ApproxConfigError> {
        config.validate()?;
        Ok(Self {
            index: KvIndex::new(),
            config,
            state: Mutex::default(),
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &ApproxConfig {
        &self.config
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a routing decision: `worker` will hold the request's blocks `hashes` from `now`
    /// on. Expires what is due first and prunes past the size bound after.
    pub fn record(&self, worker: WorkerKey, hashes: &BlockHashes, now: Instant) -> ApproxOutcome {
        self.record_blocks(worker, hashes, 0..hashes.sequence.len(), now)
    }

    /// [`Self::record`] for the blocks of `hashes` at positions `blocks` alone, as if the
    /// whole prompt were recorded at `now`: a long prompt can be recorded in parts, in order,
    /// each under the lock a short while, with the same `now` (so its blocks share one
    /// expiry and the predictions stay prefix-closed).
    pub fn record_blocks(
        &self,
        worker: WorkerKey,
        hashes: &BlockHashes,
        blocks: Range<usize>,
        now: Instant,
    ) -> ApproxOutcome {
        let mut state = self.lock();
        let mut outcome = self.expire_locked(&mut state, now);
        let expiry = now + self.config.ttl;
        let mut run: Vec<StoredBlock> = Vec::new();
        let mut run_parent = None;
        let end = blocks
            .end
            .min(hashes.local.len())
            .min(hashes.sequence.len());
        for depth in blocks.start..end {
            let (local, sequence) = (hashes.local[depth], hashes.sequence[depth]);
            // Depths past u32::MAX share the last value; only the tie-break order uses them.
            let depth32 = u32::try_from(depth).unwrap_or(u32::MAX);
            match state.predictions.insert(worker, sequence, depth32, expiry) {
                Insert::Refreshed => {
                    outcome.refreshed += 1;
                    self.store_run(worker, run_parent, &mut run);
                }
                Insert::New => {
                    outcome.inserted += 1;
                    if run.is_empty() {
                        run_parent = depth.checked_sub(1).map(|p| {
                            let parent = hashes.sequence[p];
                            BlockParent {
                                external: ExternalHash(parent.0),
                                sequence: parent,
                            }
                        });
                    }
                    run.push(StoredBlock {
                        external: ExternalHash(sequence.0),
                        local,
                        sequence,
                    });
                }
            }
        }
        self.store_run(worker, run_parent, &mut run);
        if state.predictions.len() > self.config.max_blocks {
            let mut removed = Vec::new();
            state
                .predictions
                .prune_to(self.config.prune_target(), &mut outcome, |w, s| {
                    removed.push((w, s))
                });
            self.remove_all(removed);
        }
        state.totals += outcome;
        outcome
    }

    /// Applies a run of newly predicted consecutive blocks to the inner index.
    fn store_run(
        &self,
        worker: WorkerKey,
        parent: Option<BlockParent>,
        run: &mut Vec<StoredBlock>,
    ) {
        if run.is_empty() {
            return;
        }
        let blocks = std::mem::take(run);
        self.index
            .apply(worker, &KvEvent::Stored { parent, blocks });
    }

    /// Removes predicted pairs from the inner index, one Removed event per worker.
    fn remove_all(&self, mut removed: Vec<(WorkerKey, SequenceHash)>) {
        removed.sort_unstable();
        for group in removed.chunk_by(|a, b| a.0 == b.0) {
            let blocks = group.iter().map(|&(_, s)| ExternalHash(s.0)).collect();
            self.index.apply(group[0].0, &KvEvent::Removed { blocks });
        }
    }

    fn expire_locked(&self, state: &mut State, now: Instant) -> ApproxOutcome {
        let mut outcome = ApproxOutcome::default();
        let mut removed = Vec::new();
        state
            .predictions
            .expire(now, &mut outcome, |w, s| removed.push((w, s)));
        self.remove_all(removed);
        outcome
    }

    /// Drops every prediction that expired at or before `now` (for a periodic tick).
    pub fn expire(&self, now: Instant) -> ApproxOutcome {
        let mut state = self.lock();
        let outcome = self.expire_locked(&mut state, now);
        state.totals += outcome;
        outcome
    }

    /// Like [`KvIndex::find_matches`] on the predictions. First expires what is due at `now`,
    /// unless another thread holds the predictions (then it does not wait, and pairs that expired
    /// since the last expiry pass may still match).
    pub fn find_matches(&self, query: &[SequenceHash], now: Instant) -> OverlapScores {
        let state = match self.state.try_lock() {
            Ok(state) => Some(state),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if let Some(mut state) = state {
            let outcome = self.expire_locked(&mut state, now);
            state.totals += outcome;
        }
        self.index.find_matches(query)
    }

    /// Forgets every prediction for every data-parallel rank of `instance_id`.
    pub fn remove_worker(&self, instance_id: u64) {
        let mut state = self.lock();
        state.predictions.forget_instance(instance_id);
        self.index.remove_worker(instance_id);
    }

    /// Every worker with predictions, with its number of predicted blocks.
    pub fn cached_blocks(&self) -> Vec<(WorkerKey, u64)> {
        self.index.cached_blocks()
    }

    /// Current size and running totals.
    pub fn stats(&self) -> ApproxStats {
        let state = self.lock();
        ApproxStats {
            predicted_blocks: state.predictions.len(),
            totals: state.totals,
        }
    }

    /// Totals of the inner index.
    pub fn index_stats(&self) -> IndexStats {
        self.index.stats()
    }
}

#[cfg(test)]
mod tests;

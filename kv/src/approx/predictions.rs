//! The predicted (worker, block) pairs with their expiry, and a lazy min-heap to drop them in
//! order: earliest expiry first, deepest block first among equal expiries.
//!
//! Each live pair has exactly one heap item. A refresh (a later expiry for a predicted pair)
//! only updates the pair: its item keeps the old expiry until it reaches the top, and is then
//! queued again at the pair's current one. So refreshes cost one map probe, and the heap never
//! fills with stale items that a rebuild would have to clear (a long prompt sent again
//! refreshes thousands of pairs at once; rebuilding a heap of a million items took
//! milliseconds on the request path).

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use crate::hash::SequenceHash;
use crate::keyed_hasher::KeyedState;
use crate::worker::WorkerKey;

use super::outcome::ApproxOutcome;

/// One predicted pair.
#[derive(Debug, Clone, Copy)]
struct Prediction {
    expiry: Instant,
    depth: u32,
}

/// A heap item; behind when the pair's current expiry is later (it was refreshed), stale when
/// the pair is gone. Field order is the eviction order: expiry, then deeper first, then key
/// for determinism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    expiry: Instant,
    deeper_first: Reverse<u32>,
    worker: WorkerKey,
    sequence: SequenceHash,
}

/// The result of inserting one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Insert {
    /// The pair was not predicted before.
    New,
    /// The pair was predicted; its expiry now is the later of the old and the new one.
    Refreshed,
}

/// Predicted pairs and their eviction heap.
#[derive(Debug, Default)]
pub(crate) struct Predictions {
    entries: HashMap<(WorkerKey, SequenceHash), Prediction, KeyedState>,
    heap: BinaryHeap<Reverse<Candidate>>,
}

impl Predictions {
    /// Number of predicted pairs.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Predicts that `worker` holds `sequence` (at `depth` in its request) until `expiry`.
    pub(crate) fn insert(
        &mut self,
        worker: WorkerKey,
        sequence: SequenceHash,
        depth: u32,
        expiry: Instant,
    ) -> Insert {
        match self.entries.entry((worker, sequence)) {
            Entry::Occupied(mut existing) => {
                let existing = existing.get_mut();
                existing.expiry = existing.expiry.max(expiry);
                Insert::Refreshed
            }
            Entry::Vacant(vacant) => {
                let prediction = Prediction { expiry, depth };
                vacant.insert(prediction);
                self.push(worker, sequence, prediction);
                Insert::New
            }
        }
    }

    fn push(&mut self, worker: WorkerKey, sequence: SequenceHash, prediction: Prediction) {
        self.heap.push(Reverse(Candidate {
            expiry: prediction.expiry,
            deeper_first: Reverse(prediction.depth),
            worker,
            sequence,
        }));
    }

    /// Pops the next live pair in eviction order if `take` accepts its expiry. An item behind
    /// its pair's refreshed expiry goes back into the heap at that expiry.
    fn pop_if(&mut self, take: impl Fn(Instant) -> bool) -> Option<(WorkerKey, SequenceHash)> {
        while let Some(Reverse(top)) = self.heap.peek().copied() {
            if !take(top.expiry) {
                return None;
            }
            self.heap.pop();
            let key = (top.worker, top.sequence);
            match self.entries.get(&key).copied() {
                Some(live) if live.expiry == top.expiry => {
                    self.entries.remove(&key);
                    return Some(key);
                }
                Some(refreshed) => self.push(top.worker, top.sequence, refreshed),
                None => {}
            }
        }
        None
    }

    /// Drops every pair whose expiry is at or before `now`, passing each to `removed`.
    pub(crate) fn expire(
        &mut self,
        now: Instant,
        outcome: &mut ApproxOutcome,
        mut removed: impl FnMut(WorkerKey, SequenceHash),
    ) {
        while let Some((worker, sequence)) = self.pop_if(|expiry| expiry <= now) {
            outcome.expired += 1;
            removed(worker, sequence);
        }
        self.compact();
    }

    /// Drops pairs in eviction order until at most `target` are left.
    pub(crate) fn prune_to(
        &mut self,
        target: usize,
        outcome: &mut ApproxOutcome,
        mut removed: impl FnMut(WorkerKey, SequenceHash),
    ) {
        while self.entries.len() > target {
            let Some((worker, sequence)) = self.pop_if(|_| true) else {
                break;
            };
            outcome.pruned += 1;
            removed(worker, sequence);
        }
        self.compact();
    }

    /// Drops every pair of `instance_id`'s workers (their heap items go stale).
    pub(crate) fn forget_instance(&mut self, instance_id: u64) {
        self.entries
            .retain(|(worker, _), _| worker.instance_id != instance_id);
        self.compact();
    }

    /// Rebuilds the heap from the live pairs once stale items (of pairs dropped with an
    /// instance) outnumber them.
    fn compact(&mut self) {
        if self.heap.len() <= 2 * self.entries.len() + 1024 {
            return;
        }
        self.heap = self
            .entries
            .iter()
            .map(|(&(worker, sequence), prediction)| {
                Reverse(Candidate {
                    expiry: prediction.expiry,
                    deeper_first: Reverse(prediction.depth),
                    worker,
                    sequence,
                })
            })
            .collect();
    }

    /// Heap items, live and stale (for tests of compaction).
    #[cfg(test)]
    pub(crate) fn heap_len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const W: WorkerKey = WorkerKey::new(1, 0);

    #[test]
    fn refreshes_keep_the_later_expiry_and_push_no_heap_item() {
        let t0 = Instant::now();
        let mut predictions = Predictions::default();
        assert_eq!(
            predictions.insert(W, SequenceHash(1), 0, t0 + Duration::from_secs(5)),
            Insert::New
        );
        assert_eq!(
            predictions.insert(W, SequenceHash(1), 0, t0 + Duration::from_secs(3)),
            Insert::Refreshed
        );
        let mut outcome = ApproxOutcome::default();
        let mut gone = Vec::new();
        predictions.expire(t0 + Duration::from_secs(4), &mut outcome, |w, s| {
            gone.push((w, s))
        });
        assert!(
            gone.is_empty(),
            "an earlier re-insert must not shorten the TTL"
        );
        for i in 0..10_000u64 {
            predictions.insert(W, SequenceHash(1), 0, t0 + Duration::from_secs(10 + i));
        }
        assert_eq!(predictions.heap_len(), 1, "a refresh pushes nothing");
        predictions.expire(t0 + Duration::from_secs(9), &mut outcome, |w, s| {
            gone.push((w, s))
        });
        assert!(
            gone.is_empty(),
            "the pair's item was queued again at its refreshed expiry"
        );
        assert_eq!(predictions.heap_len(), 1);
        predictions.expire(t0 + Duration::from_secs(20_000), &mut outcome, |w, s| {
            gone.push((w, s))
        });
        assert_eq!(gone, vec![(W, SequenceHash(1))]);
        assert_eq!(outcome.expired, 1);
    }

    #[test]
    fn pruning_follows_the_refreshed_expiries() {
        let t0 = Instant::now();
        let at = |secs| t0 + Duration::from_secs(secs);
        let mut predictions = Predictions::default();
        predictions.insert(W, SequenceHash(1), 0, at(5));
        predictions.insert(W, SequenceHash(2), 1, at(6));
        predictions.insert(W, SequenceHash(3), 2, at(6));
        assert_eq!(
            predictions.insert(W, SequenceHash(1), 0, at(7)),
            Insert::Refreshed
        );
        let mut outcome = ApproxOutcome::default();
        let mut gone = Vec::new();
        predictions.prune_to(1, &mut outcome, |_, s| gone.push(s));
        assert_eq!(
            gone,
            vec![SequenceHash(3), SequenceHash(2)],
            "the refreshed pair goes last; of equal expiries the deeper first"
        );
        assert_eq!(outcome.pruned, 2);
        assert_eq!(predictions.len(), 1);
        assert_eq!(predictions.heap_len(), 1);
    }
}

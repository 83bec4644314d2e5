//! The predicted (worker, block) pairs with their expiry, and a lazy min-heap to drop them in
//! order: earliest expiry first, deepest block first among equal expiries.

use std::cmp::Reverse;
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

/// A heap item; stale when the pair's current expiry differs (it was refreshed or dropped).
/// Field order is the eviction order: expiry, then deeper first, then key for determinism.
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
        let (result, prediction) = match self.entries.get_mut(&(worker, sequence)) {
            Some(existing) if existing.expiry >= expiry => return Insert::Refreshed,
            Some(existing) => {
                existing.expiry = expiry;
                (Insert::Refreshed, *existing)
            }
            None => {
                let prediction = Prediction { expiry, depth };
                self.entries.insert((worker, sequence), prediction);
                (Insert::New, prediction)
            }
        };
        self.push(worker, sequence, prediction);
        result
    }

    fn push(&mut self, worker: WorkerKey, sequence: SequenceHash, prediction: Prediction) {
        self.heap.push(Reverse(Candidate {
            expiry: prediction.expiry,
            deeper_first: Reverse(prediction.depth),
            worker,
            sequence,
        }));
    }

    /// Pops the next live pair in eviction order if `take` accepts its expiry.
    fn pop_if(&mut self, take: impl Fn(Instant) -> bool) -> Option<(WorkerKey, SequenceHash)> {
        while let Some(Reverse(top)) = self.heap.peek().copied() {
            if !take(top.expiry) {
                return None;
            }
            self.heap.pop();
            let key = (top.worker, top.sequence);
            if self
                .entries
                .get(&key)
                .is_some_and(|live| live.expiry == top.expiry)
            {
                self.entries.remove(&key);
                return Some(key);
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

    /// Rebuilds the heap from the live pairs once stale items outnumber them, so refreshes
    /// cannot grow it without bound.
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
    fn refreshes_keep_the_later_expiry_and_the_heap_stays_bounded() {
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
        predictions.expire(t0, &mut outcome, |_, _| {});
        assert!(predictions.heap_len() <= 2 * predictions.len() + 1024);
        predictions.expire(t0 + Duration::from_secs(20_000), &mut outcome, |w, s| {
            gone.push((w, s))
        });
        assert_eq!(gone, vec![(W, SequenceHash(1))]);
        assert_eq!(outcome.expired, 1);
    }
}

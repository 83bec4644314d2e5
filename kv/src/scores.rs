//! The result of a prefix lookup: how deep each worker's cache matches a request.

use crate::worker::WorkerKey;

/// One worker's match against a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerOverlap {
    /// The worker.
    pub worker: WorkerKey,
    /// Matched prefix depth in blocks: the request's first `depth` blocks are cached there.
    pub depth: u32,
    /// Distinct blocks the worker has in the index (a tie-breaker: Dynamo's `tree_sizes`).
    pub cached_blocks: u64,
}

/// Workers whose cache holds at least the first block of a request, sorted by worker key.
/// Workers with no overlap are absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// One entry per matching worker, sorted by `worker`.
    pub workers: Vec<WorkerOverlap>,
}

impl OverlapScores {
    /// Matched depth in blocks of `worker` (0 when it matches nothing).
    pub fn depth(&self, worker: WorkerKey) -> u32 {
        self.workers
            .binary_search_by_key(&worker, |overlap| overlap.worker)
            .map_or(0, |at| self.workers[at].depth)
    }

    /// The deepest match over all workers, in blocks.
    pub fn max_depth(&self) -> u32 {
        self.workers.iter().map(|o| o.depth).max().unwrap_or(0)
    }

    /// Both `self` and `other`: for a worker in both, the deeper match (and the larger
    /// cached-block count).
    pub fn merge(self, other: OverlapScores) -> OverlapScores {
        if other.workers.is_empty() {
            return self;
        }
        if self.workers.is_empty() {
            return other;
        }
        let mut workers = Vec::with_capacity(self.workers.len() + other.workers.len());
        let (mut left, mut right) = (
            self.workers.into_iter().peekable(),
            other.workers.into_iter().peekable(),
        );
        loop {
            let next = match (left.peek(), right.peek()) {
                (Some(a), Some(b)) if a.worker == b.worker => {
                    let (a, b) = (left.next(), right.next());
                    a.zip(b).map(|(a, b)| WorkerOverlap {
                        worker: a.worker,
                        depth: a.depth.max(b.depth),
                        cached_blocks: a.cached_blocks.max(b.cached_blocks),
                    })
                }
                (Some(a), Some(b)) if a.worker < b.worker => left.next(),
                (Some(_), Some(_)) => right.next(),
                (Some(_), None) => left.next(),
                (None, Some(_)) => right.next(),
                (None, None) => break,
            };
            workers.extend(next);
        }
        OverlapScores { workers }
    }

    /// Whether no worker matches.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores(entries: &[(u64, u32, u64)]) -> OverlapScores {
        OverlapScores {
            workers: entries
                .iter()
                .map(|&(instance, depth, cached_blocks)| WorkerOverlap {
                    worker: WorkerKey::new(instance, 0),
                    depth,
                    cached_blocks,
                })
                .collect(),
        }
    }

    #[test]
    fn merging_keeps_every_worker_sorted_with_its_deeper_match() {
        let events = scores(&[(1, 3, 10), (3, 5, 7), (4, 1, 1)]);
        let predicted = scores(&[(0, 2, 2), (3, 6, 6), (4, 0, 0), (9, 1, 1)]);
        assert_eq!(
            events.clone().merge(predicted.clone()),
            scores(&[(0, 2, 2), (1, 3, 10), (3, 6, 7), (4, 1, 1), (9, 1, 1)])
        );
        assert_eq!(
            predicted.clone().merge(events.clone()),
            events.clone().merge(predicted)
        );
        assert_eq!(events.clone().merge(OverlapScores::default()), events);
        assert_eq!(OverlapScores::default().merge(events.clone()), events);
    }

    #[test]
    fn depth_lookup() {
        let a = WorkerKey::new(1, 0);
        let b = WorkerKey::new(2, 0);
        let scores = OverlapScores {
            workers: vec![WorkerOverlap {
                worker: a,
                depth: 3,
                cached_blocks: 9,
            }],
        };
        assert_eq!(scores.depth(a), 3);
        assert_eq!(scores.depth(b), 0);
        assert_eq!(scores.max_depth(), 3);
        assert!(OverlapScores::default().is_empty());
    }
}

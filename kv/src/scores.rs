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

    /// Whether no worker matches.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

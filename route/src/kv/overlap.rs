//! Where a model's cached-prefix overlaps come from: the seam between routing and the KV index.
//!
//! Today there is one source, [`Approximate`]: without KV events, the proxy predicts each
//! instance's cache from its own decisions (`kv.approx_ttl`, `kv.approx_max_blocks`,
//! `kv.approx_prune_ratio`). When the worker-agent publishes KV events, a second implementation
//! wraps a [`kvmesh_kv::KvIndex`] fed by the event intake: its `find_matches` reads that index and
//! its `record` does nothing (the engines report what they cache). The router only talks to
//! this trait, so nothing else changes.
//!
//! Workers are keyed by the instance's stable id ([`crate::Candidate::id`]): a
//! static backend's position in `backends`, a discovered instance's agent-chosen id. Routing
//! decisions are recorded under rank 0; KV events name their data-parallel rank, and an
//! instance's overlap is its deepest rank ([`instance_depth`]).

use std::fmt;
use std::time::Instant;

use kvmesh_kv::{
    ApproxConfig, ApproxConfigError, ApproxIndex, BlockHashes, OverlapScores, SequenceHash,
    WorkerKey,
};

/// A source of per-instance prefix overlaps for one model.
pub(crate) trait OverlapSource: Send + Sync + fmt::Debug {
    /// How many leading blocks of `query` each instance caches.
    fn find_matches(&self, query: &[SequenceHash], now: Instant) -> OverlapScores;
    /// [`find_matches`](Self::find_matches), with the part the engines reported themselves
    /// (their KV events, without this proxy's predictions) where that is known apart.
    fn find_matches_reported(
        &self,
        query: &[SequenceHash],
        now: Instant,
    ) -> (OverlapScores, Option<OverlapScores>) {
        (self.find_matches(query, now), None)
    }
    /// A routing decision sent `blocks` to `worker` at `now`; returns how many predicted
    /// blocks were pruned to stay under the size bound.
    fn record(&self, worker: WorkerKey, blocks: &BlockHashes, now: Instant) -> u64;
    /// Drops what is due at `now` (a periodic tick).
    fn expire(&self, now: Instant);
    /// Every worker with cached blocks, with how many.
    fn cached_blocks(&self) -> Vec<(WorkerKey, u64)>;
    /// Forgets every block of instance `instance` (it left the pool).
    fn remove_instance(&self, instance: u64);
}

/// The worker key under which routing decisions for instance `instance` are recorded: the
/// rank the request was sent to (`None`: the engine chose; recorded under rank 0).
pub(crate) fn worker_key(instance: u64, rank: Option<u32>) -> WorkerKey {
    WorkerKey::new(instance, rank.unwrap_or(0))
}

/// Instance `instance`'s overlap in `scores`: its deepest data-parallel rank (the engine
/// places a request on a rank itself).
pub(crate) fn instance_depth(scores: &OverlapScores, instance: u64) -> u32 {
    let start = scores
        .workers
        .partition_point(|overlap| overlap.worker.instance_id < instance);
    scores.workers[start..]
        .iter()
        .take_while(|overlap| overlap.worker.instance_id == instance)
        .map(|overlap| overlap.depth)
        .max()
        .unwrap_or(0)
}

/// The data-parallel rank of instance `instance` that caches the longest prefix in `scores`
/// (the lowest of equals), when one caches any.
pub(crate) fn deepest_rank(scores: &OverlapScores, instance: u64) -> Option<u32> {
    let start = scores
        .workers
        .partition_point(|overlap| overlap.worker.instance_id < instance);
    scores.workers[start..]
        .iter()
        .take_while(|overlap| overlap.worker.instance_id == instance)
        .filter(|overlap| overlap.depth > 0)
        .max_by_key(|overlap| (overlap.depth, std::cmp::Reverse(overlap.worker.dp_rank)))
        .map(|overlap| overlap.worker.dp_rank)
}

/// Approximate mode: caches predicted from routing decisions.
#[derive(Debug)]
pub(crate) struct Approximate {
    index: ApproxIndex,
}

impl Approximate {
    /// An empty prediction index.
    pub(crate) fn new(config: ApproxConfig) -> Result<Self, ApproxConfigError> {
        Ok(Self {
            index: ApproxIndex::new(config)?,
        })
    }
}

impl OverlapSource for Approximate {
    fn find_matches(&self, query: &[SequenceHash], now: Instant) -> OverlapScores {
        self.index.find_matches(query, now)
    }

    fn record(&self, worker: WorkerKey, blocks: &BlockHashes, now: Instant) -> u64 {
        self.index.record(worker, blocks, now).pruned
    }

    fn expire(&self, now: Instant) {
        self.index.expire(now);
    }

    fn cached_blocks(&self) -> Vec<(WorkerKey, u64)> {
        self.index.cached_blocks()
    }

    fn remove_instance(&self, instance: u64) {
        self.index.remove_worker(instance);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kvmesh_kv::BlockHasher;

    use super::*;

    #[test]
    fn decisions_predict_overlaps_until_the_ttl() {
        let config = ApproxConfig {
            ttl: Duration::from_secs(10),
            ..ApproxConfig::default()
        };
        let source = Approximate::new(config).unwrap();
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let prompt = hasher.hash(&(0..16).collect::<Vec<u32>>());
        let longer = hasher.hash(&(0..24).collect::<Vec<u32>>());
        let start = Instant::now();
        assert!(source.find_matches(&longer.sequence, start).is_empty());
        assert_eq!(source.record(worker_key(2, None), &prompt, start), 0);
        let scores = source.find_matches(&longer.sequence, start);
        assert_eq!(scores.depth(worker_key(2, None)), 4);
        assert_eq!(scores.depth(worker_key(0, None)), 0);
        assert_eq!(source.cached_blocks(), [(worker_key(2, None), 4)]);
        source.remove_instance(2);
        assert!(source.cached_blocks().is_empty());
        assert_eq!(source.record(worker_key(2, None), &prompt, start), 0);
        source.expire(start + Duration::from_secs(11));
        assert!(
            source
                .find_matches(&longer.sequence, start + Duration::from_secs(11))
                .is_empty()
        );
    }

    #[test]
    fn an_instance_overlap_is_its_deepest_rank() {
        use kvmesh_kv::WorkerOverlap;
        let overlap = |instance, rank, depth| WorkerOverlap {
            worker: WorkerKey::new(instance, rank),
            depth,
            cached_blocks: 0,
        };
        let scores = OverlapScores {
            workers: vec![
                overlap(1, 0, 2),
                overlap(3, 0, 1),
                overlap(3, 1, 5),
                overlap(9, 2, 4),
                overlap(11, 0, 0),
                overlap(12, 0, 3),
                overlap(12, 1, 3),
            ],
        };
        assert_eq!(instance_depth(&scores, 1), 2);
        assert_eq!(instance_depth(&scores, 3), 5);
        assert_eq!(instance_depth(&scores, 9), 4);
        assert_eq!(instance_depth(&scores, 2), 0);
        assert_eq!(instance_depth(&scores, 10), 0);
        // The rank holding the most; none when no rank holds any; the lowest of equals.
        assert_eq!(deepest_rank(&scores, 3), Some(1));
        assert_eq!(deepest_rank(&scores, 9), Some(2));
        assert_eq!(deepest_rank(&scores, 10), None);
        assert_eq!(deepest_rank(&scores, 11), None);
        assert_eq!(deepest_rank(&scores, 12), Some(0));
    }

    #[test]
    fn the_size_bound_prunes() {
        let config = ApproxConfig {
            max_blocks: 4,
            prune_target_ratio: 0.5,
            ..ApproxConfig::default()
        };
        let source = Approximate::new(config).unwrap();
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let prompt = hasher.hash(&(0..24).collect::<Vec<u32>>());
        assert_eq!(
            source.record(worker_key(0, None), &prompt, Instant::now()),
            4
        );
    }
}

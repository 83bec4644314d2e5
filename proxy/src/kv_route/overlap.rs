//! Where a model's cached-prefix overlaps come from: the seam between routing and the KV index.
//!
//! Today there is one source, [`Approximate`]: without KV events, the proxy predicts each
//! instance's cache from its own decisions (`kv.approx_ttl`, `kv.approx_max_blocks`,
//! `kv.approx_prune_ratio`). When the worker-agent publishes KV events, a second implementation
//! wraps a [`kvmesh_kv::KvIndex`] fed by the event intake: its `find_matches` reads that index and
//! its `record` does nothing (the engines report what they cache). The router only talks to
//! this trait, so nothing else changes.
//!
//! Instance `i` of a model is worker `(i, 0)` in the index.

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
    /// A routing decision sent `blocks` to `worker` at `now`; returns how many predicted
    /// blocks were pruned to stay under the size bound.
    fn record(&self, worker: WorkerKey, blocks: &BlockHashes, now: Instant) -> u64;
    /// Drops what is due at `now` (a periodic tick).
    fn expire(&self, now: Instant);
    /// Every worker with cached blocks, with how many.
    fn cached_blocks(&self) -> Vec<(WorkerKey, u64)>;
}

/// The worker key of instance `index`.
pub(crate) fn worker_key(index: usize) -> WorkerKey {
    WorkerKey::new(index as u64, 0)
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
        assert_eq!(source.record(worker_key(2), &prompt, start), 0);
        let scores = source.find_matches(&longer.sequence, start);
        assert_eq!(scores.depth(worker_key(2)), 4);
        assert_eq!(scores.depth(worker_key(0)), 0);
        assert_eq!(source.cached_blocks(), [(worker_key(2), 4)]);
        source.expire(start + Duration::from_secs(11));
        assert!(
            source
                .find_matches(&longer.sequence, start + Duration::from_secs(11))
                .is_empty()
        );
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
        assert_eq!(source.record(worker_key(0), &prompt, Instant::now()), 4);
    }
}

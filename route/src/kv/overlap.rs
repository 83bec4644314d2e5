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
//! decisions are recorded under rank 0; KV events name their data-parallel rank and cache tier,
//! and an instance's overlap is its deepest rank's device overlap ([`instance_depth`]), plus
//! what its host memory and disk hold beyond it, weighted ([`lower_tier_blocks`]).

use std::fmt;
use std::ops::Range;
use std::time::Instant;

use serde::Serialize;

use kvmesh_kv::{
    ApproxConfig, ApproxConfigError, ApproxIndex, BlockHashes, CacheTier, OverlapScores,
    SequenceHash, WorkerKey, WorkerOverlap,
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
    fn record(&self, worker: WorkerKey, blocks: &BlockHashes, now: Instant) -> u64 {
        self.record_blocks(worker, blocks, 0..blocks.sequence.len(), now)
    }
    /// [`record`](Self::record) for the blocks at positions `range` alone: a long prompt
    /// is recorded in steps, in order, all at the decision's `now`
    /// ([`crate::kv::prediction`]).
    fn record_blocks(
        &self,
        worker: WorkerKey,
        blocks: &BlockHashes,
        range: Range<usize>,
        now: Instant,
    ) -> u64;
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

/// Instance `instance`'s workers in `scores` (sorted by key, so by rank, then tier).
fn instance_workers(scores: &OverlapScores, instance: u64) -> impl Iterator<Item = &WorkerOverlap> {
    let start = scores
        .workers
        .partition_point(|overlap| overlap.worker.instance_id < instance);
    scores.workers[start..]
        .iter()
        .take_while(move |overlap| overlap.worker.instance_id == instance)
}

/// Instance `instance`'s overlap in device memory in `scores`: its deepest data-parallel
/// rank (the engine places a request on a rank itself).
pub(crate) fn instance_depth(scores: &OverlapScores, instance: u64) -> u32 {
    instance_workers(scores, instance)
        .filter(|overlap| overlap.worker.tier == CacheTier::Device)
        .map(|overlap| overlap.depth)
        .max()
        .unwrap_or(0)
}

/// Instance `instance`'s overlap in any tier: the prefix its engine finds cached, in device
/// memory or loaded back from host memory or disk (what its `cached_tokens` shows).
pub(crate) fn cached_depth(scores: &OverlapScores, instance: u64) -> u32 {
    instance_workers(scores, instance)
        .map(|overlap| overlap.depth)
        .max()
        .unwrap_or(0)
}

/// How far instance `instance`'s lower tiers reach past its device overlap: the blocks its
/// engine would load back from host memory and from disk rather than compute, per rank the
/// deepest of them (a rank's host blocks beyond its device prefix, its disk blocks beyond
/// both), for the rank where they weigh most under `weights`.
pub(crate) fn lower_tier_blocks(
    scores: &OverlapScores,
    instance: u64,
    weights: TierWeights,
) -> LowerTierBlocks {
    let mut best = LowerTierBlocks::default();
    let mut depths: Option<(u32, [u32; 3])> = None;
    let mut consider = |depths: &[u32; 3]| {
        let host = depths[1].saturating_sub(depths[0]);
        let disk = depths[2].saturating_sub(depths[0].max(depths[1]));
        let blocks = LowerTierBlocks { host, disk };
        if blocks.weighted(weights) > best.weighted(weights) {
            best = blocks;
        }
    };
    for overlap in instance_workers(scores, instance) {
        let rank = overlap.worker.dp_rank;
        match &mut depths {
            Some((current, tiers)) if *current == rank => {
                tiers[overlap.worker.tier as usize] = overlap.depth;
            }
            _ => {
                if let Some((_, tiers)) = &depths {
                    consider(tiers);
                }
                let mut tiers = [0; 3];
                tiers[overlap.worker.tier as usize] = overlap.depth;
                depths = Some((rank, tiers));
            }
        }
    }
    if let Some((_, tiers)) = &depths {
        consider(tiers);
    }
    best
}

/// What a hit in each lower tier is worth against a device hit (`kv.tier_weights`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct TierWeights {
    /// A block loaded back from host memory.
    pub(crate) host: f64,
    /// A block loaded back from disk.
    pub(crate) disk: f64,
}

/// Blocks past the device overlap an instance's lower tiers hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LowerTierBlocks {
    /// In host memory.
    pub(crate) host: u32,
    /// On disk.
    pub(crate) disk: u32,
}

impl LowerTierBlocks {
    /// Their worth in device blocks.
    pub(crate) fn weighted(self, weights: TierWeights) -> f64 {
        f64::from(self.host) * weights.host + f64::from(self.disk) * weights.disk
    }
}

/// The data-parallel rank of instance `instance` that caches the longest prefix in `scores`
/// (the lowest of equals), when one caches any.
pub(crate) fn deepest_rank(scores: &OverlapScores, instance: u64) -> Option<u32> {
    instance_workers(scores, instance)
        .filter(|overlap| overlap.worker.tier == CacheTier::Device && overlap.depth > 0)
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

    fn record_blocks(
        &self,
        worker: WorkerKey,
        blocks: &BlockHashes,
        range: Range<usize>,
        now: Instant,
    ) -> u64 {
        self.index.record_blocks(worker, blocks, range, now).pruned
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
    fn lower_tiers_count_past_the_device_overlap_of_one_rank_at_their_weight() {
        let overlap = |instance, rank, tier, depth| WorkerOverlap {
            worker: WorkerKey::new(instance, rank).in_tier(tier),
            depth,
            cached_blocks: 0,
        };
        let (device, host, disk) = (CacheTier::Device, CacheTier::Host, CacheTier::Disk);
        let scores = OverlapScores {
            workers: vec![
                // Instance 1: 2 blocks on the GPU, 6 in host memory, 10 on disk.
                overlap(1, 0, device, 2),
                overlap(1, 0, host, 6),
                overlap(1, 0, disk, 10),
                // Instance 2: only host memory, on rank 1; rank 0 has the GPU blocks.
                overlap(2, 0, device, 3),
                overlap(2, 1, host, 5),
                // Instance 3: host memory shorter than the device overlap.
                overlap(3, 0, device, 4),
                overlap(3, 0, host, 2),
            ],
        };
        let weights = TierWeights {
            host: 0.75,
            disk: 0.25,
        };
        // Device depth ignores the lower tiers; the engine finds all tiers cached.
        assert_eq!(instance_depth(&scores, 1), 2);
        assert_eq!(cached_depth(&scores, 1), 10);
        assert_eq!(deepest_rank(&scores, 2), Some(0));
        let blocks = lower_tier_blocks(&scores, 1, weights);
        assert_eq!(blocks, LowerTierBlocks { host: 4, disk: 4 });
        assert_eq!(blocks.weighted(weights), 4.0 * 0.75 + 4.0 * 0.25);
        // Rank 1's host blocks reach past nothing on rank 1: all 5 count.
        assert_eq!(
            lower_tier_blocks(&scores, 2, weights),
            LowerTierBlocks { host: 5, disk: 0 }
        );
        assert_eq!(
            lower_tier_blocks(&scores, 3, weights),
            LowerTierBlocks::default()
        );
        assert_eq!(
            lower_tier_blocks(&scores, 4, weights),
            LowerTierBlocks::default()
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
        assert_eq!(
            source.record(worker_key(0, None), &prompt, Instant::now()),
            4
        );
    }
}

//! The oracle: prefix-cache hit rates a perfect router could reach on a workload.
//!
//! Both models see the prompts in arrival order, cut into full blocks of the engines' block
//! size and identified by kvmesh's prefix-chained sequence hashes (so a block matches only with
//! its whole prefix). A request's hit is the longest run of leading blocks the cache holds,
//! capped like vLLM's: at least the last prompt token is always computed, so a prompt of
//! exactly `k` blocks can hit at most `k − 1`. Rates are token-weighted, hit tokens over prompt
//! tokens, like the engines' `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`.
//!
//! - **Infinite** (`infinite_hit_rate`): every block any earlier request had is a hit. No
//!   router and no cache size can do better; an upper bound for every lane.
//! - **Pooled LRU** (`hit_rate`, the oracle): an all-knowing router that sends every request
//!   where its longest prefix lives and never duplicates a block, which together behave like
//!   one LRU cache holding all engines' blocks (`engines × blocks_per_engine`). After a request
//!   its blocks are the most recently used, the first block most of all (vLLM frees a
//!   sequence tail first, so deep blocks are evicted before shared prefixes). It is optimistic:
//!   a request's blocks count as cached from its arrival (a real engine has them once their
//!   prefill ran) and blocks held by running requests never crowd the cache.
//!
//! Generated tokens are left out: the workloads never send an engine's output back to it.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvmesh_kv::{BlockHasher, BlockHashes, HashError, SequenceHash};
use serde::Serialize;

/// Cache size and block size of the simulated fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OracleSpec {
    /// Tokens per KV block (the engines' block size).
    pub block_size: usize,
    /// Engines in the fleet.
    pub engines: usize,
    /// KV capacity of one engine, in blocks.
    pub blocks_per_engine: usize,
}

/// The oracle's verdict over a whole workload.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OracleReport {
    /// Model of `hit_rate`.
    pub model: &'static str,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks of the pooled cache (`engines × blocks_per_engine`).
    pub capacity_blocks: u64,
    /// Requests seen.
    pub requests: u64,
    /// Prompt tokens over all requests (the engines' prefix-cache queries, if nothing was
    /// preempted).
    pub prompt_tokens: u64,
    /// Hit tokens of the pooled-LRU oracle.
    pub hit_tokens: u64,
    /// `hit_tokens / prompt_tokens` of the pooled-LRU oracle.
    pub hit_rate: f64,
    /// Hit tokens with an infinite cache.
    pub infinite_hit_tokens: u64,
    /// `infinite_hit_tokens / prompt_tokens`: the upper bound of any router.
    pub infinite_hit_rate: f64,
}

/// Feeds prompts in arrival order and reports both oracle hit rates.
#[derive(Debug)]
pub struct Oracle {
    spec: OracleSpec,
    hasher: BlockHasher,
    hashes: BlockHashes,
    seen: HashSet<SequenceHash>,
    lru: Lru,
    requests: u64,
    prompt_tokens: u64,
    hit_tokens: u64,
    infinite_hit_tokens: u64,
}

impl Oracle {
    /// An oracle for `spec` with nothing cached.
    pub fn new(spec: OracleSpec) -> Result<Self, HashError> {
        let capacity = spec.engines.saturating_mul(spec.blocks_per_engine);
        Ok(Self {
            spec,
            hasher: BlockHasher::new(spec.block_size, None)?,
            hashes: BlockHashes::default(),
            seen: HashSet::new(),
            lru: Lru::new(capacity),
            requests: 0,
            prompt_tokens: 0,
            hit_tokens: 0,
            infinite_hit_tokens: 0,
        })
    }

    /// Accounts one request with prompt `tokens`.
    pub fn observe(&mut self, tokens: &[u32]) {
        self.hasher.hash_into(tokens, &mut self.hashes);
        let blocks = &self.hashes.sequence;
        let max_hit = (tokens.len().saturating_sub(1) / self.spec.block_size).min(blocks.len());
        let infinite = blocks[..max_hit]
            .iter()
            .take_while(|b| self.seen.contains(b))
            .count();
        let pooled = blocks[..max_hit]
            .iter()
            .take_while(|b| self.lru.contains(**b))
            .count();
        self.seen.extend(blocks.iter().copied());
        self.lru.touch_all(blocks);
        self.requests += 1;
        self.prompt_tokens += tokens.len() as u64;
        self.hit_tokens += (pooled * self.spec.block_size) as u64;
        self.infinite_hit_tokens += (infinite * self.spec.block_size) as u64;
    }

    /// The hit rates so far.
    pub fn report(&self) -> OracleReport {
        let rate = |hits: u64| {
            if self.prompt_tokens == 0 {
                0.0
            } else {
                hits as f64 / self.prompt_tokens as f64
            }
        };
        OracleReport {
            model: "pooled LRU: one LRU cache of all engines' blocks, perfect placement",
            block_size: self.spec.block_size,
            capacity_blocks: self.lru.capacity as u64,
            requests: self.requests,
            prompt_tokens: self.prompt_tokens,
            hit_tokens: self.hit_tokens,
            hit_rate: rate(self.hit_tokens),
            infinite_hit_tokens: self.infinite_hit_tokens,
            infinite_hit_rate: rate(self.infinite_hit_tokens),
        }
    }
}

/// A least-recently-used set of blocks with a fixed capacity.
#[derive(Debug)]
struct Lru {
    capacity: usize,
    clock: u64,
    stamp_of: HashMap<SequenceHash, u64>,
    by_stamp: BTreeMap<u64, SequenceHash>,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            clock: 0,
            stamp_of: HashMap::new(),
            by_stamp: BTreeMap::new(),
        }
    }

    fn contains(&self, block: SequenceHash) -> bool {
        self.stamp_of.contains_key(&block)
    }

    /// Marks `blocks` used, the first most recently, then evicts down to the capacity.
    fn touch_all(&mut self, blocks: &[SequenceHash]) {
        for &block in blocks.iter().rev() {
            self.clock += 1;
            if let Some(old) = self.stamp_of.insert(block, self.clock) {
                self.by_stamp.remove(&old);
            }
            self.by_stamp.insert(self.clock, block);
        }
        while self.stamp_of.len() > self.capacity {
            let Some((_, oldest)) = self.by_stamp.pop_first() else {
                break;
            };
            self.stamp_of.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oracle(engines: usize, blocks_per_engine: usize) -> Oracle {
        Oracle::new(OracleSpec {
            block_size: 4,
            engines,
            blocks_per_engine,
        })
        .expect("block size")
    }

    fn tokens(blocks: &[u32], tail: usize) -> Vec<u32> {
        let mut out: Vec<u32> = blocks.iter().flat_map(|&b| [b; 4]).collect();
        out.extend(std::iter::repeat_n(99, tail));
        out
    }

    #[test]
    fn repeats_hit_their_full_blocks_but_never_the_last_token() {
        let mut o = oracle(1, 100);
        o.observe(&tokens(&[1, 2, 3], 2));
        o.observe(&tokens(&[1, 2, 3], 2));
        // An exact multiple of the block size leaves its last block to compute.
        o.observe(&tokens(&[1, 2, 3], 0));
        let r = o.report();
        assert_eq!(r.requests, 3);
        assert_eq!(r.prompt_tokens, 14 + 14 + 12);
        assert_eq!(r.hit_tokens, 12 + 8);
        assert_eq!(r.infinite_hit_tokens, 12 + 8);
        assert!((r.hit_rate - 20.0 / 40.0).abs() < 1e-12);
    }

    #[test]
    fn a_block_matches_only_behind_its_own_prefix() {
        let mut o = oracle(1, 100);
        o.observe(&tokens(&[1, 2], 1));
        o.observe(&tokens(&[5, 2], 1));
        o.observe(&tokens(&[1, 7], 1));
        assert_eq!(o.report().hit_tokens, 4);
    }

    #[test]
    fn a_small_pool_evicts_least_recently_used_tails_first() {
        // Capacity 4 blocks (2 engines × 2).
        let mut o = oracle(2, 2);
        o.observe(&tokens(&[1, 2, 3], 1));
        o.observe(&tokens(&[4], 1));
        // Pool now holds 1, 2, 3 (1 newest of those) and 4; nothing evicted.
        o.observe(&tokens(&[5, 6], 1));
        // 6 blocks > 4: the two oldest go, i.e. the tail 3 then 2 of the first request.
        o.observe(&tokens(&[1, 2, 3], 1));
        let r = o.report();
        assert_eq!(r.hit_tokens, 4, "only block 1 survived");
        assert_eq!(
            r.infinite_hit_tokens, 12,
            "the infinite cache kept everything"
        );
        assert!(r.hit_rate <= r.infinite_hit_rate);
        assert_eq!(r.capacity_blocks, 4);
    }

    #[test]
    fn empty_workload_reports_zero() {
        let r = oracle(8, 16).report();
        assert_eq!(r.hit_rate, 0.0);
        assert_eq!(r.infinite_hit_rate, 0.0);
        assert!(
            Oracle::new(OracleSpec {
                block_size: 0,
                engines: 1,
                blocks_per_engine: 1
            })
            .is_err()
        );
    }
}

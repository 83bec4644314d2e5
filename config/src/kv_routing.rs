//! Settings of the KV-aware routing policy (`policy: kv`).

use std::time::Duration;

use serde::Deserialize;

/// Tokens per KV block of a model whose `kv.block_size` is unset and whose block size no
/// instance record has given (static backends only): vLLM's default on GPUs.
pub const FALLBACK_BLOCK_SIZE: usize = 16;

/// Longest accepted `approx_ttl` (one year), so expiry instants never overflow.
pub const MAX_APPROX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// How `policy: kv` scores a model's instances, predicts their caches and sheds load.
///
/// Used only when the model's `policy` is `kv`. The nullable thresholds
/// (`total_kv_blocks`, `busy_decode_blocks_fraction`, `busy_prefill_tokens`) are off
/// when `null` or `0`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvRoutingConfig {
    /// Tokens per KV block; must equal the engines' block size (vLLM `--block-size`).
    /// `null` (default): the block size of the model's first instance record (the engine's
    /// own, which its agent registers), or [`FALLBACK_BLOCK_SIZE`] (16) for a model with
    /// static backends only. An instance whose engine runs another block size is scored by
    /// predictions alone and reported (admin `/health` says `degraded`).
    pub block_size: Option<usize>,
    /// Weight of the predicted prefill time against the decode time in the cost
    /// (`speed × (overlap_weight × prefill_ms + decode_ms) + harm_weight × harm_ms`).
    pub overlap_weight: f64,
    /// Weight of the harm a request's prefill does to the streams running on an instance
    /// (their summed stall, ms); 0: only the request's own time to first token counts.
    pub harm_weight: f64,
    /// Weight of the wait a request's own prefill adds to the requests queued for prefill on
    /// an instance (its marginal prefill time × those requests, ms): the work a choice adds to a
    /// queue delays the requests that will arrive behind it about as many as wait there now,
    /// so under load an instance that must recompute a cached prompt pays for it; 0: only the
    /// request's own time to first token counts.
    pub queue_weight: f64,
    /// Weight of the work a request's own prefill puts on an instance (its uncached tokens'
    /// prefill time at the instance's learned speed, ms), whatever waits there now: work spent
    /// recomputing a prompt another instance caches is capacity every later request there
    /// loses; 0: only the request's own time to first token counts.
    pub work_weight: f64,
    /// How fast the cached-prefix credit shrinks as an instance's prefill backlog exceeds the
    /// least-loaded instance's: credit × `1 / (1 + decay × excess iterations)`; 0: never.
    pub overlap_credit_decay: f64,
    /// What a cached block in a lower tier is worth against one in device memory, from 0
    /// (as good as a miss) to 1 (as good as a device hit): the engine loads it back instead of
    /// computing it (vLLM's offloading connectors report such blocks with `medium` `CPU`).
    pub tier_weights: KvTierWeights,
    /// 0: always the cheapest instance; above 0: a softmax draw over range-normalised
    /// costs, flatter as it grows.
    pub temperature: f64,
    /// How long a routing decision predicts that the chosen instance caches the
    /// request's blocks (approximate mode, no KV events).
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub approx_ttl: Duration,
    /// Most predicted (instance, block) pairs kept; past it the earliest-expiring are pruned.
    pub approx_max_blocks: usize,
    /// Pruning keeps `approx_max_blocks × approx_prune_ratio` pairs; in (0, 1].
    pub approx_prune_ratio: f64,
    /// Most (instance, block) pairs the event-fed KV index keeps (≈ 40–56 bytes each); past it,
    /// each event evicts up to twice the blocks it stores, from the least recently used
    /// instance's oldest blocks; `null` or 0: no bound.
    pub index_max_blocks: Option<u64>,
    /// KV cache capacity of one instance in blocks (vLLM `num_gpu_blocks`), for the decode
    /// busy threshold; `null` or 0: unknown (no decode threshold).
    pub total_kv_blocks: Option<u64>,
    /// An instance is busy when its active decode blocks exceed this fraction of
    /// `total_kv_blocks`; `null` or 0: off.
    pub busy_decode_blocks_fraction: Option<f64>,
    /// An instance is busy when its active prefill tokens exceed this; `null` or 0: off.
    pub busy_prefill_tokens: Option<u64>,
    /// What happens when every instance is busy.
    pub queue: KvQueueConfig,
    /// Request header naming a session: requests of one session go to the instance it is
    /// bound to while it is not busy; empty: no session affinity.
    pub session_header: String,
    /// How long a session stays bound after its last request.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub session_ttl: Duration,
    /// Count the output a stream has generated (a block per `block_size` events) in its
    /// instance's active blocks until it ends.
    pub track_output_blocks: bool,
    /// In-flight requests older than this are dropped from the load accounting
    /// (their stream never ended as far as the proxy could tell).
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub stale_request_timeout: Duration,
    /// Checking the KV index against the engines' own `cached_tokens`.
    pub cache_check: KvCacheCheckConfig,
    /// Checking the proxy's tokenizer and chat template against each engine's `/tokenize`.
    pub tokenizer_check: KvTokenizerCheckConfig,
    /// With several proxy replicas on one NATS: how long a replica waits for the model's
    /// decider (the live replica with the lowest id) to route a request before routing it
    /// alone; 0: every replica routes alone.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub decider_timeout: Duration,
}

impl Default for KvRoutingConfig {
    fn default() -> Self {
        Self {
            block_size: None,
            overlap_weight: 1.0,
            harm_weight: 0.0,
            queue_weight: 1.0,
            work_weight: 2.0,
            overlap_credit_decay: 0.0,
            tier_weights: KvTierWeights::default(),
            temperature: 0.0,
            approx_ttl: Duration::from_secs(120),
            approx_max_blocks: 1 << 20,
            approx_prune_ratio: 0.8,
            index_max_blocks: None,
            total_kv_blocks: Some(16_384),
            busy_decode_blocks_fraction: Some(1.0),
            busy_prefill_tokens: Some(10_000_000),
            queue: KvQueueConfig::default(),
            session_header: "x-session-id".to_string(),
            session_ttl: Duration::from_secs(600),
            track_output_blocks: false,
            stale_request_timeout: Duration::from_secs(300),
            cache_check: KvCacheCheckConfig::default(),
            tokenizer_check: KvTokenizerCheckConfig::default(),
            decider_timeout: Duration::from_millis(50),
        }
    }
}

impl KvRoutingConfig {
    /// `block_size`, or [`FALLBACK_BLOCK_SIZE`] when unset (or 0).
    pub fn block_size_or_fallback(&self) -> usize {
        self.block_size
            .filter(|&size| size > 0)
            .unwrap_or(FALLBACK_BLOCK_SIZE)
    }

    /// Active decode blocks above which an instance is busy, when both
    /// `total_kv_blocks` and `busy_decode_blocks_fraction` are on.
    pub fn busy_decode_blocks(&self) -> Option<f64> {
        let total = self.total_kv_blocks.filter(|&total| total > 0)?;
        let fraction = self.busy_decode_blocks_fraction.filter(|&f| f > 0.0)?;
        Some(total as f64 * fraction)
    }

    /// Active prefill tokens above which an instance is busy, when on.
    pub fn busy_prefill_tokens_limit(&self) -> Option<u64> {
        self.busy_prefill_tokens.filter(|&limit| limit > 0)
    }
}

/// What a block in host memory or on disk counts for in `policy: kv`'s cost, as a share of a
/// block in device memory. The defaults are NVIDIA Dynamo's KV router's (0.75 and 0.25); see
/// docs/configuration.md for what they rest on.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvTierWeights {
    /// A block in host (CPU) memory; in [0, 1].
    pub host: f64,
    /// A block on disk; in [0, 1].
    pub disk: f64,
}

impl Default for KvTierWeights {
    fn default() -> Self {
        Self {
            host: 0.75,
            disk: 0.25,
        }
    }
}

/// The admission queue of `policy: kv`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvQueueConfig {
    /// Requests that may wait for a non-busy instance; 0: none wait, every request
    /// arriving while all instances are busy gets 503 with `Retry-After`.
    pub max_size: usize,
    /// Longest wait in the queue; then 503.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub timeout: Duration,
}

impl Default for KvQueueConfig {
    fn default() -> Self {
        Self {
            max_size: 0,
            timeout: Duration::from_secs(5),
        }
    }
}

/// How `policy: kv` checks its KV index against what the engines report they had cached
/// (`usage.prompt_tokens_details.cached_tokens`, with KV events only).
///
/// An instance whose last `window` judged answers disagreed with the index `mismatches`
/// times or more is scored by predictions alone and resynced from its agent.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvCacheCheckConfig {
    /// Judged answers remembered per instance; 0: the check is off.
    pub window: usize,
    /// Disagreements among them that make the instance approximate and resync it; in
    /// `1..=window`.
    pub mismatches: usize,
}

impl Default for KvCacheCheckConfig {
    fn default() -> Self {
        Self {
            window: 8,
            mismatches: 3,
        }
    }
}

/// How `policy: kv` checks, once per instance when it registers, that the model's tokenizer
/// and chat template give the token ids its engine gives (`POST /tokenize` with a few probe
/// prompts): an engine that tokenizes otherwise can never match the proxy's block hashes.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvTokenizerCheckConfig {
    /// Compare (the model needs a `tokenizer`); false: never compared.
    pub enabled: bool,
    /// How long to keep asking an engine that does not answer yet (it may still be
    /// starting); then the instance stays unchecked.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub deadline: Duration,
    /// Longest wait for one answer.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub timeout: Duration,
}

impl Default for KvTokenizerCheckConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            deadline: Duration::from_secs(600),
            timeout: Duration::from_secs(10),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_are_off_when_null_or_zero() {
        let config = KvRoutingConfig::default();
        assert_eq!(config.busy_decode_blocks(), Some(16_384.0));
        assert_eq!(config.busy_prefill_tokens_limit(), Some(10_000_000));
        for (total, fraction) in [(None, Some(1.0)), (Some(0), Some(1.0)), (Some(8), None)] {
            let config = KvRoutingConfig {
                total_kv_blocks: total,
                busy_decode_blocks_fraction: fraction,
                ..KvRoutingConfig::default()
            };
            assert_eq!(config.busy_decode_blocks(), None);
        }
        let half = KvRoutingConfig {
            total_kv_blocks: Some(100),
            busy_decode_blocks_fraction: Some(0.5),
            busy_prefill_tokens: Some(0),
            ..KvRoutingConfig::default()
        };
        assert_eq!(half.busy_decode_blocks(), Some(50.0));
        assert_eq!(half.busy_prefill_tokens_limit(), None);
    }
}

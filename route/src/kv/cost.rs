//! The cost of sending one request to one instance, in predicted milliseconds, lower is
//! better:
//!
//! ```text
//! cost = speed × (overlap_weight × prefill_ms + decode_ms) + harm_weight × harm_ms
//!        + queue_weight × queue_ms + work_weight × work_ms
//! ```
//!
//! - `prefill_ms`: the prefill work queued there ahead of the request plus its own uncached
//!   prompt tokens, run in chunks of [`EngineProfile::chunk_tokens`] (one engine iteration
//!   each), at the engine's prefill speed;
//! - `decode_ms`: what the streams already running there add: they ride in the prefill's
//!   iterations (one forward pass), each carrying the decode step's part above an idle
//!   cache's, which grows with the share of the KV cache in use (with this request); and
//!   the request first waits half the decode step in flight; none on an idle instance;
//! - `speed`: how much slower (above 1) or faster than [`EngineProfile::DEFAULT`] this
//!   instance proved to be, learned from the first-token times of its streamed requests
//!   ([`crate::kv::load`]); so `speed × (prefill_ms + decode_ms)` is the predicted time to
//!   first token. The profile's per-token terms are first scaled by the model's learned
//!   token factor ([`crate::kv::token_cost`]): how much more an engine spends per token,
//!   against an iteration's fixed part, than the profile says;
//! - `harm_ms`: the stall this request's own prefill causes the streams running there, summed
//!   over those streams;
//! - `queue_ms`: the wait this request's prefill adds to the requests queued for prefill there
//!   (its own tokens' prefill time, without an iteration's fixed part, at the instance's
//!   learned speed, times those requests). They stand for the requests that will arrive
//!   behind it while its work is queued: a queue that is long now is long when they come. On
//!   an idle fleet it is 0; under load it charges a choice for the work it adds. Without it,
//!   a fleet past its capacity lost its reuse: each request took whichever queue was shortest
//!   by a few milliseconds, recomputing its cached prompt there, and that work lengthened
//!   every queue (docs/BENCHMARKS.md, *Past the fleet's capacity*);
//! - `work_ms`: the work this request's prefill puts on the instance whatever waits there
//!   now (its own tokens' prefill time, without an iteration's fixed part, at the learned
//!   speed). Recomputing a prompt another instance caches spends capacity every later request
//!   there pays for, and a copy of the prompt's blocks that crowds others out of the cache;
//!   charged, a conversation stays with its cache unless leaving it saves more than that work
//!   (docs/BENCHMARKS.md, *The request's own work*).
//!
//! An instance caching a prefix of the prompt skips prefilling it: the cached tokens are the
//! overlap credit. Blocks past its device overlap that its host memory or disk hold count at
//! `kv.tier_weights` of a device block each (loading them back costs the rest). Under `overlap_credit_decay` the credit shrinks as the instance's prefill
//! backlog exceeds the least-loaded candidate's (Dynamo's anti-hot-spot decay), so a cache-rich
//! but swamped instance stops drawing every request of its prefix.

/// The request's size, the same for every candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestShape {
    /// Prompt tokens (isl).
    pub(crate) tokens: u64,
    /// Full blocks of the prompt (the hashed ones).
    pub(crate) full_blocks: u32,
    /// Blocks the request occupies: full blocks plus a trailing partial one.
    pub(crate) blocks: u64,
    /// A disaggregated decode leg: prompt tokens whose KV a prefill engine computed, pulled
    /// by the instance instead of prefilled (what it does not cache; 0 otherwise).
    pub(crate) pulled_tokens: u64,
    /// Nanoseconds the pull of one token's KV takes.
    pub(crate) transfer_ns_per_token: u64,
}

impl RequestShape {
    /// The shape of a `tokens`-token prompt in blocks of `block_size`.
    pub(crate) fn new(tokens: u64, block_size: u64) -> Self {
        let block_size = block_size.max(1);
        let full = tokens / block_size;
        Self {
            tokens,
            full_blocks: u32::try_from(full).unwrap_or(u32::MAX),
            blocks: tokens.div_ceil(block_size),
            pulled_tokens: 0,
            transfer_ns_per_token: 0,
        }
    }
}

/// How long an engine takes to prefill and to run a decode iteration, before what the proxy
/// learns per instance scales it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct EngineProfile {
    /// Milliseconds of an iteration that prefills anything at all.
    pub(crate) prefill_fixed_ms: f64,
    /// Milliseconds per prefilled token.
    pub(crate) prefill_ms_per_token: f64,
    /// Milliseconds per squared prefilled token of one iteration (attention's quadratic part).
    pub(crate) prefill_ms_per_token_squared: f64,
    /// Milliseconds a decode iteration adds with an empty KV cache.
    pub(crate) decode_idle_ms: f64,
    /// Milliseconds a decode iteration adds with a full KV cache.
    pub(crate) decode_full_ms: f64,
    /// Prefill tokens one iteration takes at most (vLLM `max_num_batched_tokens`).
    pub(crate) chunk_tokens: u64,
}

impl EngineProfile {
    /// An 8B-class model on one H100-class GPU, as NVIDIA Dynamo's mocker profiles vLLM (its
    /// polynomial timing model): 16.5 ms + 0.0152 ms/token + 4.2e-7 ms/token² per prefill
    /// iteration, 5.7 ms to 34 ms per decode iteration from an empty to a full KV cache,
    /// 8,192-token iterations.
    pub(crate) const DEFAULT: Self = Self {
        prefill_fixed_ms: 16.501_42,
        prefill_ms_per_token: 0.015_183_44,
        prefill_ms_per_token_squared: 4.209_989e-7,
        decode_idle_ms: 5.74,
        decode_full_ms: 34.01,
        chunk_tokens: 8192,
    };

    /// This profile with its per-token terms (linear and quadratic) `factor` times theirs.
    pub(crate) fn with_token_factor(self, factor: f64) -> Self {
        Self {
            prefill_ms_per_token: self.prefill_ms_per_token * factor,
            prefill_ms_per_token_squared: self.prefill_ms_per_token_squared * factor,
            ..self
        }
    }

    /// One iteration prefilling `tokens` tokens (0: no prefill, no time).
    pub(crate) fn iteration_prefill_ms(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        self.prefill_fixed_ms
            + self.prefill_ms_per_token * t
            + self.prefill_ms_per_token_squared * t * t
    }

    /// Prefilling `tokens` tokens in full iterations: the time and the iterations it takes.
    pub(crate) fn prefill_ms(&self, tokens: u64) -> (f64, u64) {
        let chunk = self.chunk_tokens.max(1);
        let full = tokens / chunk;
        let rest = tokens % chunk;
        let time = full as f64 * self.iteration_prefill_ms(chunk) + self.iteration_prefill_ms(rest);
        (time, full + u64::from(rest > 0))
    }

    /// What running streams add to one iteration with `usage` (0 to 1) of the KV cache in use:
    /// rising fast at first, then flattening (the mocker's curve, within 0.7 ms).
    pub(crate) fn decode_ms(&self, usage: f64) -> f64 {
        let u = usage.clamp(0.0, 1.0);
        self.decode_idle_ms + (self.decode_full_ms - self.decode_idle_ms) * u * (2.0 - u)
    }
}

/// What one candidate instance holds and already caches for this request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CandidateLoad {
    /// Leading blocks of the request the instance caches in device memory (KV index).
    pub(crate) overlap_blocks: u32,
    /// The blocks after those its host memory or disk hold, in device blocks' worth
    /// (`kv.tier_weights`): loaded back rather than computed.
    pub(crate) lower_tier_blocks: f64,
    /// Prompt tokens of its requests still in prefill.
    pub(crate) active_prefill_tokens: u64,
    /// Distinct blocks held by its in-flight requests.
    pub(crate) active_blocks: u64,
    /// Leading blocks of the request already among those active blocks.
    pub(crate) active_prefix_blocks: u32,
    /// The proxy's requests in flight there (the streams a prefill stalls).
    pub(crate) requests: u64,
    /// Requests queued there for prefill (still before their first token): the proxy's own,
    /// the other replicas' and those the engine reported waiting beyond them.
    pub(crate) queued_requests: u64,
    /// Its KV capacity in blocks (0: unknown, then the cache counts as full).
    pub(crate) total_blocks: u64,
    /// Its learned slowness against the profile (1: as profiled).
    pub(crate) speed: f64,
    /// The share of the overlap credited (1 without decay).
    pub(crate) credit: f64,
}

impl Default for CandidateLoad {
    fn default() -> Self {
        Self {
            overlap_blocks: 0,
            lower_tier_blocks: 0.0,
            active_prefill_tokens: 0,
            active_blocks: 0,
            active_prefix_blocks: 0,
            requests: 0,
            queued_requests: 0,
            total_blocks: 16_384,
            speed: 1.0,
            credit: 1.0,
        }
    }
}

/// The cost of one candidate and its parts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Cost {
    /// Prompt tokens this request would have to prefill there.
    pub(crate) new_prefill_tokens: u64,
    /// Active prefill tokens with this request.
    pub(crate) prefill_tokens: u64,
    /// Active blocks with this request.
    pub(crate) decode_blocks: u64,
    /// Time to first token as profiled, before the instance's learned speed.
    pub(crate) profiled_ttft_ms: f64,
    /// The part of it spent per prefilled token (the profile's per-token terms), before the
    /// learned token factor: what that factor is learned from.
    pub(crate) profiled_token_ms: f64,
    /// The part of it that is this request's own prefill (its iterations, with what the
    /// running streams add to each), as profiled: how long the engine works on it once the
    /// prefill queued ahead of it is done.
    pub(crate) profiled_own_ms: f64,
    /// Predicted time to first token there.
    pub(crate) ttft_ms: f64,
    /// Predicted time between its tokens there once it decodes: one decode iteration with
    /// its blocks added to the KV cache in use, at the instance's learned speed.
    pub(crate) itl_ms: f64,
    /// Predicted stall of the running streams, summed over them.
    pub(crate) harm_ms: f64,
    /// Predicted wait this request's prefill adds to the requests queued there, summed over
    /// them.
    pub(crate) queue_ms: f64,
    /// The work this request's own prefill puts on the instance: its uncached tokens'
    /// prefill time, without an iteration's fixed part, at the instance's learned speed.
    pub(crate) work_ms: f64,
    /// The cost (module docs).
    pub(crate) value: f64,
}

impl Cost {
    /// Prompt tokens the request would have to prefill there (the part it does not cache).
    pub fn new_prefill_tokens(&self) -> u64 {
        self.new_prefill_tokens
    }

    /// Predicted time to its first token there, ms.
    pub fn ttft_ms(&self) -> f64 {
        self.ttft_ms
    }

    /// Predicted time between its tokens there, ms.
    pub fn itl_ms(&self) -> f64 {
        self.itl_ms
    }
}

/// The cost's profile and weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CostModel {
    /// Tokens per block.
    pub(crate) block_size: u64,
    /// Weight of the prefill time.
    pub(crate) overlap_weight: f64,
    /// Weight of the harm to running streams.
    pub(crate) harm_weight: f64,
    /// Weight of the wait added to the requests queued for prefill.
    pub(crate) queue_weight: f64,
    /// Weight of the request's own prefill work.
    pub(crate) work_weight: f64,
    /// How fast the overlap credit decays with prefill backlog (0: never).
    pub(crate) overlap_credit_decay: f64,
    /// The engines' speed before learning.
    pub(crate) profile: EngineProfile,
    /// The model's learned token factor ([`crate::kv::token_cost`]; 1: as profiled).
    pub(crate) token_factor: f64,
}

impl CostModel {
    /// The share of its overlap an instance with `backlog` prefill tokens is credited when the
    /// least-loaded candidate has `least_backlog`: `1 / (1 + decay × excess)`, the excess in
    /// iterations' worth of tokens.
    pub(crate) fn credit(&self, backlog: u64, least_backlog: u64) -> f64 {
        let excess =
            backlog.saturating_sub(least_backlog) as f64 / self.profile.chunk_tokens.max(1) as f64;
        1.0 / (1.0 + self.overlap_credit_decay.max(0.0) * excess)
    }

    /// The cost of sending a request of `shape` to a candidate with `load`.
    pub(crate) fn cost(&self, shape: &RequestShape, load: &CandidateLoad) -> Cost {
        let token_factor = if self.token_factor.is_finite() && self.token_factor > 0.0 {
            self.token_factor
        } else {
            1.0
        };
        let profile = self.profile.with_token_factor(token_factor);
        let overlap = (f64::from(load.overlap_blocks) + load.lower_tier_blocks.max(0.0))
            .min(f64::from(shape.full_blocks));
        let cached_tokens = (overlap * self.block_size as f64) as u64;
        let credited = (cached_tokens as f64 * load.credit.clamp(0.0, 1.0)) as u64;
        // A decode leg pulls the full blocks it does not cache instead of prefilling them.
        let full_tokens = u64::from(shape.full_blocks).saturating_mul(self.block_size);
        let pulled = shape.pulled_tokens.min(full_tokens);
        let transfer_ms =
            pulled.saturating_sub(credited) as f64 * shape.transfer_ns_per_token as f64 / 1e6;
        let new_prefill_tokens = shape.tokens.saturating_sub(credited.max(pulled));
        let prefill_tokens = load
            .active_prefill_tokens
            .saturating_add(new_prefill_tokens);
        let shared = u64::from(load.active_prefix_blocks.min(shape.full_blocks));
        let decode_blocks = load
            .active_blocks
            .saturating_add(shape.blocks.saturating_sub(shared));
        // The engine computes at least one token of every prompt.
        let (prefill_ms, iterations) = profile.prefill_ms(prefill_tokens.max(1));
        let usage = if load.total_blocks == 0 {
            1.0
        } else {
            decode_blocks as f64 / load.total_blocks as f64
        };
        // Any active block (the proxy's own or the engine's reported) is a running stream.
        // Running streams ride in the prefill's iterations (one forward pass reads the
        // weights for both): each iteration carries what their KV reads add, the decode
        // step's part above an idle cache's, not a whole step; and the request first waits
        // for the step in flight when it arrives, half a step on average.
        let (decode_step_ms, step_wait_ms) = if load.active_blocks > 0 {
            let step = profile.decode_ms(usage);
            (step - profile.decode_idle_ms, 0.5 * step)
        } else {
            (0.0, 0.0)
        };
        let decode_ms = iterations as f64 * decode_step_ms + step_wait_ms;
        let speed = if load.speed.is_finite() && load.speed > 0.0 {
            load.speed
        } else {
            1.0
        };
        let (own_prefill_ms, own_iterations) = profile.prefill_ms(new_prefill_tokens.max(1));
        let harm_ms = speed * own_prefill_ms * load.requests as f64;
        // The requests queued there now stand for those that will queue behind it. Batched
        // with theirs, its tokens add work but no iteration of their own.
        let own_tokens_ms = own_prefill_ms - own_iterations as f64 * profile.prefill_fixed_ms;
        let work_ms = speed * own_tokens_ms.max(0.0);
        let queue_ms = work_ms * load.queued_requests as f64;
        let profiled_ttft_ms = prefill_ms + transfer_ms + decode_ms;
        let token_ms = (prefill_ms - iterations as f64 * profile.prefill_fixed_ms).max(0.0);
        Cost {
            new_prefill_tokens,
            prefill_tokens,
            decode_blocks,
            profiled_ttft_ms,
            profiled_token_ms: token_ms / token_factor,
            profiled_own_ms: own_prefill_ms + own_iterations as f64 * decode_step_ms,
            ttft_ms: speed * profiled_ttft_ms,
            itl_ms: speed * profile.decode_ms(usage),
            harm_ms,
            queue_ms,
            work_ms,
            value: speed * (self.overlap_weight * (prefill_ms + transfer_ms) + decode_ms)
                + self.harm_weight * harm_ms
                + self.queue_weight * queue_ms
                + self.work_weight * work_ms,
        }
    }
}

#[cfg(test)]
mod tests;

//! The cost of sending one request to one instance (Dynamo's April-2026 formula, kv-routing
//! §5.1): `overlap_weight × prefill_blocks + decode_blocks`, lower is better, where both terms
//! are the loads the instance would have *with* this request:
//!
//! - `prefill_blocks = (active_prefill_tokens + max(0, tokens − overlap_blocks × block_size)) / block_size`
//!   (as a float: partial blocks of prefill count pro rata);
//! - `decode_blocks = active_blocks + (request_blocks − prefix already among the instance's active blocks)`.
//!
//! `request_blocks` counts the prompt's full blocks plus one for a trailing partial block,
//! so short prompts still weigh something.

/// The request's size, the same for every candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestShape {
    /// Prompt tokens (isl).
    pub(crate) tokens: u64,
    /// Full blocks of the prompt (the hashed ones).
    pub(crate) full_blocks: u32,
    /// Blocks the request occupies: full blocks plus a trailing partial one.
    pub(crate) blocks: u64,
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
        }
    }
}

/// What one candidate instance holds and already caches for this request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CandidateLoad {
    /// Leading blocks of the request the instance caches (KV index).
    pub(crate) overlap_blocks: u32,
    /// Prompt tokens of its requests still in prefill.
    pub(crate) active_prefill_tokens: u64,
    /// Distinct blocks held by its in-flight requests.
    pub(crate) active_blocks: u64,
    /// Leading blocks of the request already among those active blocks.
    pub(crate) active_prefix_blocks: u32,
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
    /// `overlap_weight × prefill_tokens / block_size + decode_blocks`.
    pub(crate) value: f64,
}

/// Weights of the cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct CostModel {
    /// Tokens per block.
    pub(crate) block_size: u64,
    /// Weight of the prefill term.
    pub(crate) overlap_weight: f64,
}

impl CostModel {
    /// The cost of sending a request of `shape` to a candidate with `load`.
    pub(crate) fn cost(&self, shape: &RequestShape, load: &CandidateLoad) -> Cost {
        let overlap = load.overlap_blocks.min(shape.full_blocks);
        let cached_tokens = u64::from(overlap).saturating_mul(self.block_size);
        let new_prefill_tokens = shape.tokens.saturating_sub(cached_tokens);
        let prefill_tokens = load
            .active_prefill_tokens
            .saturating_add(new_prefill_tokens);
        let shared = u64::from(load.active_prefix_blocks.min(shape.full_blocks));
        let decode_blocks = load
            .active_blocks
            .saturating_add(shape.blocks.saturating_sub(shared));
        let prefill_blocks = prefill_tokens as f64 / self.block_size.max(1) as f64;
        Cost {
            new_prefill_tokens,
            prefill_tokens,
            decode_blocks,
            value: self.overlap_weight * prefill_blocks + decode_blocks as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: CostModel = CostModel {
        block_size: 16,
        overlap_weight: 1.0,
    };

    #[test]
    fn shapes_count_a_partial_tail_block() {
        assert_eq!(
            RequestShape::new(40, 16),
            RequestShape {
                tokens: 40,
                full_blocks: 2,
                blocks: 3
            }
        );
        assert_eq!(RequestShape::new(32, 16).blocks, 2);
        assert_eq!(RequestShape::new(0, 16), RequestShape::default());
    }

    #[test]
    fn costs_add_prefill_and_decode_blocks() {
        // A 128-token (8-block) request with no active prefill and overlaps of 0, 3 and 6
        // blocks has 8, 5 and 2 blocks to prefill; decode adds the active blocks and its 8.
        let shape = RequestShape::new(128, 16);
        let costs: Vec<f64> = [(0, 2), (3, 0), (6, 1)]
            .iter()
            .map(|&(overlap, active)| {
                MODEL
                    .cost(
                        &shape,
                        &CandidateLoad {
                            overlap_blocks: overlap,
                            active_blocks: active,
                            ..CandidateLoad::default()
                        },
                    )
                    .value
            })
            .collect();
        assert_eq!(costs, [8.0 + 10.0, 5.0 + 8.0, 2.0 + 9.0]);
    }

    #[test]
    fn active_load_and_shared_prefixes_are_projected() {
        let shape = RequestShape::new(100, 16); // 6 full blocks + a tail: 7 blocks
        let load = CandidateLoad {
            overlap_blocks: 4,
            active_prefill_tokens: 32,
            active_blocks: 10,
            active_prefix_blocks: 3,
        };
        let cost = MODEL.cost(&shape, &load);
        assert_eq!(cost.new_prefill_tokens, 100 - 64);
        assert_eq!(cost.prefill_tokens, 32 + 36);
        assert_eq!(cost.decode_blocks, 10 + 7 - 3);
        assert_eq!(cost.value, 68.0 / 16.0 + 14.0);
        let weighted = CostModel {
            overlap_weight: 2.0,
            ..MODEL
        };
        assert_eq!(weighted.cost(&shape, &load).value, 2.0 * 68.0 / 16.0 + 14.0);
    }

    #[test]
    fn overlaps_beyond_the_prompt_are_capped() {
        let shape = RequestShape::new(20, 16); // 1 full block
        let load = CandidateLoad {
            overlap_blocks: 9,
            active_prefix_blocks: 9,
            ..CandidateLoad::default()
        };
        let cost = MODEL.cost(&shape, &load);
        assert_eq!(cost.new_prefill_tokens, 4);
        assert_eq!(cost.decode_blocks, 1);
    }
}

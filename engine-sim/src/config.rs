//! Engine knobs: [`SimConfig`] and its validation.

use std::path::PathBuf;

use crate::error::SimError;

/// Which running sequence gives its KV blocks back when decode runs out of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PreemptionMode {
    /// Preempt the most recently admitted running sequence (vLLM v1 default).
    #[default]
    Lifo,
    /// Preempt the earliest admitted running sequence.
    Fifo,
}

/// Every knob of one simulated engine. `Default` gives the CLI defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Served model name (`/v1/models`, the `model` field of responses, the `model_name` label).
    pub model: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV cache capacity in blocks.
    pub num_gpu_blocks: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Token budget of one scheduler iteration (decode tokens first, then prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus completion accepted, in tokens.
    pub max_model_len: usize,
    /// Divides every simulated duration; a value <= 0 means real time (no scaling).
    pub speedup_ratio: f64,
    /// Further divides decode durations; a value <= 0 means no extra scaling.
    pub decode_speedup_ratio: f64,
    /// Never sleep: iterations run back to back (for proxy-overhead benchmarks).
    pub no_delay: bool,
    /// Reuse cached full blocks across requests (vLLM's automatic prefix caching).
    pub enable_prefix_caching: bool,
    /// Which sequence to preempt when decode runs out of KV blocks.
    pub preemption_mode: PreemptionMode,
    /// Path to a Hugging Face `tokenizer.json`; `None` uses the built-in fallback tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// Length of the vectors `/v1/embeddings` returns.
    pub embedding_dim: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "sim-model".to_owned(),
            block_size: 64,
            num_gpu_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8_192,
            max_model_len: 131_072,
            speedup_ratio: 1.0,
            decode_speedup_ratio: 1.0,
            no_delay: false,
            enable_prefix_caching: true,
            preemption_mode: PreemptionMode::Lifo,
            tokenizer: None,
            embedding_dim: 16,
        }
    }
}

impl SimConfig {
    /// Checks that every size is usable (positive, finite ratios).
    pub fn validate(&self) -> Result<(), SimError> {
        let positive = [
            ("block_size", self.block_size),
            ("num_gpu_blocks", self.num_gpu_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
            ("embedding_dim", self.embedding_dim),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(SimError::InvalidConfig(format!(
                    "{name} must be at least 1"
                )));
            }
        }
        if self.model.is_empty() {
            return Err(SimError::InvalidConfig(
                "model must not be empty".to_owned(),
            ));
        }
        for (name, value) in [
            ("speedup_ratio", self.speedup_ratio),
            ("decode_speedup_ratio", self.decode_speedup_ratio),
        ] {
            if !value.is_finite() {
                return Err(SimError::InvalidConfig(format!("{name} must be finite")));
            }
        }
        Ok(())
    }

    /// Number of KV blocks needed to hold `tokens` tokens.
    pub(crate) fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_cli() {
        let c = SimConfig::default();
        assert_eq!(c.model, "sim-model");
        assert_eq!(c.block_size, 64);
        assert_eq!(c.num_gpu_blocks, 16_384);
        assert_eq!(c.max_num_seqs, 256);
        assert_eq!(c.max_num_batched_tokens, 8_192);
        assert_eq!(c.max_model_len, 131_072);
        assert_eq!(c.preemption_mode, PreemptionMode::Lifo);
        assert!(c.enable_prefix_caching && !c.no_delay);
        assert_eq!(c.embedding_dim, 16);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn zero_sizes_are_rejected() {
        let c = SimConfig {
            block_size: 0,
            ..SimConfig::default()
        };
        assert!(c.validate().is_err());
        let c = SimConfig {
            speedup_ratio: f64::NAN,
            ..SimConfig::default()
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn blocks_round_up() {
        let c = SimConfig {
            block_size: 4,
            ..SimConfig::default()
        };
        assert_eq!(c.blocks_for(0), 0);
        assert_eq!(c.blocks_for(4), 1);
        assert_eq!(c.blocks_for(5), 2);
    }
}

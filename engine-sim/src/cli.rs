//! Command-line flags of the `kvmesh-engine-sim` binary (vLLM / Dynamo mocker names).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use crate::config::{PreemptionMode, SimConfig};

/// `--preemption-mode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PreemptionArg {
    /// Preempt the newest running request.
    Lifo,
    /// Preempt the oldest running request.
    Fifo,
}

/// A simulated vLLM engine: OpenAI API, vLLM metrics, prefix cache and timing model.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvmesh-engine-sim", version, about)]
pub struct Cli {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port of the first engine (the others follow); 0 picks a free port for each.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Number of engines in this process.
    #[arg(long, default_value_t = 1)]
    pub engines: usize,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// KV cache capacity in blocks.
    #[arg(long, default_value_t = 16_384)]
    pub num_gpu_blocks: usize,
    /// Most running sequences.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget per iteration.
    #[arg(long, default_value_t = 8_192)]
    pub max_num_batched_tokens: usize,
    /// Context length (prompt + completion).
    #[arg(long, default_value_t = 131_072)]
    pub max_model_len: usize,
    /// Divides all simulated durations (<= 0: real time).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub speedup_ratio: f64,
    /// Further divides decode durations (<= 0: no extra scaling).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub decode_speedup_ratio: f64,
    /// Never sleep (proxy-overhead benchmarks).
    #[arg(long)]
    pub no_delay: bool,
    /// Disable automatic prefix caching.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Which running request to preempt when KV blocks run out.
    #[arg(long, value_enum, default_value_t = PreemptionArg::Lifo)]
    pub preemption_mode: PreemptionArg,
    /// Hugging Face tokenizer.json (default: a built-in word/punctuation tokenizer).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Dimension of /v1/embeddings vectors.
    #[arg(long, default_value_t = 16)]
    pub embedding_dim: usize,
}

impl Cli {
    /// The engine configuration these flags describe.
    pub fn config(&self) -> SimConfig {
        SimConfig {
            model: self.model.clone(),
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            speedup_ratio: self.speedup_ratio,
            decode_speedup_ratio: self.decode_speedup_ratio,
            no_delay: self.no_delay,
            enable_prefix_caching: !self.no_prefix_caching,
            preemption_mode: match self.preemption_mode {
                PreemptionArg::Lifo => PreemptionMode::Lifo,
                PreemptionArg::Fifo => PreemptionMode::Fifo,
            },
            tokenizer: self.tokenizer.clone(),
            embedding_dim: self.embedding_dim,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_defaults_equal_config_defaults() {
        let cli = Cli::try_parse_from(["kvmesh-engine-sim"]).expect("defaults parse");
        assert_eq!(cli.config(), SimConfig::default());
        assert_eq!(
            (cli.host.to_string().as_str(), cli.port, cli.engines),
            ("127.0.0.1", 8000, 1)
        );
    }

    #[test]
    fn flags_map_to_config() {
        let cli = Cli::try_parse_from([
            "x",
            "--port",
            "0",
            "--engines",
            "3",
            "--no-delay",
            "--no-prefix-caching",
            "--preemption-mode",
            "fifo",
            "--block-size",
            "16",
            "--speedup-ratio",
            "0",
        ])
        .expect("valid flags");
        let c = cli.config();
        assert!(c.no_delay && !c.enable_prefix_caching);
        assert_eq!(c.preemption_mode, PreemptionMode::Fifo);
        assert_eq!((c.block_size, c.speedup_ratio, cli.engines), (16, 0.0, 3));
        assert!(Cli::try_parse_from(["x", "--preemption-mode", "random"]).is_err());
    }
}

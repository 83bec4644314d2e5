//! Command-line flags of the `kvmesh-engine-sim` binary (vLLM / Dynamo mocker names).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use crate::config::{
    DEFAULT_BOOTSTRAP_PORT, DisaggregationMode, InterferenceScaling, KvEventEncoding, KvEventHash,
    KvEventsConfig, KvTransferConfig, ModelShape, OffloadConfig, OffloadEvents, PreemptionMode,
    Role, SglangDisaggregation, SimConfig,
};
use crate::lora::LoraModule;

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
    /// Data-parallel ranks of each engine, as vLLM's `--data-parallel-size` on one API
    /// server: one HTTP port, N engine cores (own KV cache and scheduler each), KV event
    /// sockets at the configured ports plus the rank; `X-data-parallel-rank` picks one.
    #[arg(long, visible_alias = "data-parallel-size", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub dp_ranks: u16,
    /// Served model name.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Tokens per KV block (GPU vLLM's default, 16).
    #[arg(long, default_value_t = 16)]
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
    /// Report cached prompt tokens in `usage.prompt_tokens_details.cached_tokens`, as vLLM
    /// does with the same flag.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// Which running request to preempt when KV blocks run out.
    #[arg(long, value_enum, default_value_t = PreemptionArg::Lifo)]
    pub preemption_mode: PreemptionArg,
    /// Hugging Face tokenizer.json (default: a built-in word/punctuation tokenizer).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Dimension of /v1/embeddings vectors.
    #[arg(long, default_value_t = 16)]
    pub embedding_dim: usize,
    /// Publish vLLM-format KV events on a ZMQ PUB socket bound here, e.g.
    /// tcp://127.0.0.1:5557 (engine i binds port + i; port 0 picks free ports). Off when absent.
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// ZMQ ROUTER socket answering KV event replay requests (same form and port offset).
    #[arg(long, value_name = "ENDPOINT", requires = "kv_events_endpoint")]
    pub kv_events_replay_endpoint: Option<String>,
    /// First frame of every KV event message.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Event layout: maps with a `type` key (what vLLM sends) or legacy positional arrays.
    #[arg(long, value_enum, default_value_t = KvEventEncoding::Map)]
    pub kv_events_encoding: KvEventEncoding,
    /// Block hash form: u64 ints or 32-byte SHA-256 digests.
    #[arg(long, value_enum, default_value_t = KvEventHash::Int)]
    pub kv_events_hash: KvEventHash,
    /// KV event batches kept for replay.
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,
    /// Serve LoRA adapters (implied by --lora-modules); needed to load adapters at runtime.
    #[arg(long)]
    pub enable_lora: bool,
    /// LoRA adapters to load at start, each `NAME=PATH` or a JSON object
    /// `{"name": ..., "path": ..., "base_model_name": ...}`; requests name one as `model`.
    /// As in vLLM, a later --lora-modules replaces an earlier one.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH", overrides_with = "lora_modules")]
    pub lora_modules: Vec<LoraModule>,
    /// Side of disaggregated serving (vLLM's kv_role): `prefill` keeps a request's KV for a
    /// remote decode (`kv_transfer_params.do_remote_decode`), `decode` pulls a remote
    /// prefill's KV (`do_remote_prefill`); both serve plain requests.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    pub role: Role,
    /// Seconds a prefill leg's blocks wait for a decode engine to read them.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub kv_hold_timeout: f64,
    /// The model's KV shape `LAYERS,KV_HEADS,HEAD_DIM,DTYPE_BYTES` (bytes per transferred
    /// block); default Qwen3-8B's.
    #[arg(long, value_name = "L,H,D,B", default_value = "36,8,128,2", value_parser = parse_shape)]
    pub kv_shape: ModelShape,
    /// Bandwidth of the engine's inbound KV link in GB/s, shared by concurrent pulls.
    #[arg(long, value_name = "GBPS", default_value_t = 64.0)]
    pub kv_link_gbps: f64,
    /// How much longer an iteration takes while KV flows in (0.3: 30 %).
    #[arg(long, value_name = "FACTOR", default_value_t = 0.3)]
    pub kv_transfer_interference: f64,
    /// `any`: the interference once while any pull runs; `per-transfer`: once per pull in
    /// flight (a burst of concurrent pulls hurts more than the same pulls one by one).
    #[arg(long, value_enum, default_value_t = InterferenceScaling::Any)]
    pub kv_transfer_interference_scaling: InterferenceScaling,
    /// Host decode engines read this engine's held blocks at (default: the bound IP).
    #[arg(long, value_name = "HOST")]
    pub kv_side_channel_host: Option<String>,
    /// Side of SGLang's disaggregated serving (SGLang's flag): `prefill` runs a bootstrap
    /// server and answers a request once the decode engine of its `bootstrap_room` has the
    /// KV; `decode` joins that room and receives the KV before decoding. Either refuses
    /// requests without `bootstrap_room`, as SGLang does.
    #[arg(long, value_enum, default_value_t = DisaggregationMode::Null)]
    pub disaggregation_mode: DisaggregationMode,
    /// A prefill engine's bootstrap server port (engine i: the port plus i; 0 picks a free
    /// one); the port a decode leg without `bootstrap_port` contacts.
    #[arg(long, value_name = "PORT", default_value_t = DEFAULT_BOOTSTRAP_PORT)]
    pub disaggregation_bootstrap_port: u16,
    /// Seconds a prefill leg waits for its decode engine to join its room (SGLang's
    /// SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 there).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub disaggregation_bootstrap_timeout: f64,
    /// Seconds a decode leg waits for its room's KV (SGLang's
    /// SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 there).
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub disaggregation_waiting_timeout: f64,
    /// Capacity in blocks of a host-memory KV tier behind the device cache, as vLLM's
    /// OffloadingConnector (`--kv-offloading-size`, one block per chunk): every stored block is
    /// copied there, and a prompt's blocks found there after its device hit are loaded, not
    /// prefilled. 0: off.
    #[arg(long, value_name = "BLOCKS", default_value_t = 0)]
    pub offload_blocks: usize,
    /// What loading a token back from the host tier costs, as a share (0..=1) of what
    /// prefilling it in the same iteration would.
    #[arg(long, value_name = "SHARE", default_value_t = 0.25, value_parser = parse_share)]
    pub offload_load_cost: f64,
    /// The host tier's `BlockStored` events: vLLM's default `placeholder` (the hash alone,
    /// `block_size` 0) or `self-describing` (parent, tokens, block size, adapter), as with
    /// vLLM's `self_describing_kv_events`.
    #[arg(long, value_enum, default_value_t = OffloadEvents::Placeholder)]
    pub offload_events: OffloadEvents,
    /// Test hook: answer every generation request with this HTTP status (and an OpenAI-shaped
    /// error body), as an engine that keeps failing; `/health` and the rest stay up.
    #[arg(long, value_name = "CODE", value_parser = clap::value_parser!(u16).range(400..600))]
    pub fail_status: Option<u16>,
    /// Test hook: delay the response head of every generation request by this many ms, as
    /// an engine slow to its first byte.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub head_delay_ms: u64,
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
            prompt_tokens_details: self.enable_prompt_tokens_details,
            preemption_mode: match self.preemption_mode {
                PreemptionArg::Lifo => PreemptionMode::Lifo,
                PreemptionArg::Fifo => PreemptionMode::Fifo,
            },
            tokenizer: self.tokenizer.clone(),
            embedding_dim: self.embedding_dim,
            kv_events: KvEventsConfig {
                endpoint: self.kv_events_endpoint.clone(),
                replay_endpoint: self.kv_events_replay_endpoint.clone(),
                topic: self.kv_events_topic.clone(),
                encoding: self.kv_events_encoding,
                hash: self.kv_events_hash,
                buffer_steps: self.kv_events_buffer_steps,
            },
            kv_transfer: KvTransferConfig {
                role: self.role,
                hold_timeout: seconds(self.kv_hold_timeout),
                shape: self.kv_shape,
                link_gbps: self.kv_link_gbps,
                interference: self.kv_transfer_interference,
                interference_scaling: self.kv_transfer_interference_scaling,
                side_channel_host: self.kv_side_channel_host.clone(),
                sglang: SglangDisaggregation {
                    mode: self.disaggregation_mode,
                    bootstrap_port: self.disaggregation_bootstrap_port,
                    bootstrap_timeout: seconds(self.disaggregation_bootstrap_timeout),
                    waiting_timeout: seconds(self.disaggregation_waiting_timeout),
                },
            },
            enable_lora: self.enable_lora,
            lora_modules: self.lora_modules.clone(),
            fail_status: self.fail_status,
            head_delay: std::time::Duration::from_millis(self.head_delay_ms),
            dp_ranks: usize::from(self.dp_ranks),
            offload: OffloadConfig {
                blocks: self.offload_blocks,
                load_cost: self.offload_load_cost,
                events: self.offload_events,
            },
        }
    }
}

/// `secs` as a duration (zero when negative or not finite: validation refuses it).
fn seconds(secs: f64) -> std::time::Duration {
    std::time::Duration::try_from_secs_f64(secs).unwrap_or_default()
}

/// Parses a number between 0 and 1.
fn parse_share(text: &str) -> Result<f64, String> {
    let share: f64 = text.trim().parse().map_err(|e| format!("{text:?}: {e}"))?;
    if (0.0..=1.0).contains(&share) {
        Ok(share)
    } else {
        Err(format!("{text} is not between 0 and 1"))
    }
}

/// Parses `LAYERS,KV_HEADS,HEAD_DIM,DTYPE_BYTES`.
fn parse_shape(text: &str) -> Result<ModelShape, String> {
    let parts: Vec<usize> = text
        .split(',')
        .map(|part| {
            part.trim()
                .parse::<usize>()
                .map_err(|e| format!("{part:?}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let [layers, kv_heads, head_dim, dtype_bytes] = parts[..] else {
        return Err("expected four numbers: LAYERS,KV_HEADS,HEAD_DIM,DTYPE_BYTES".to_owned());
    };
    Ok(ModelShape {
        layers,
        kv_heads,
        head_dim,
        dtype_bytes,
    })
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

    #[test]
    fn sglang_disaggregation_flags_map_to_config() {
        let c = Cli::try_parse_from([
            "x",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            "0",
            "--disaggregation-bootstrap-timeout",
            "0.5",
            "--disaggregation-waiting-timeout",
            "2",
        ])
        .expect("SGLang's flags")
        .config();
        let sglang = &c.kv_transfer.sglang;
        assert_eq!(sglang.mode, DisaggregationMode::Prefill);
        assert_eq!(sglang.bootstrap_port, 0);
        assert_eq!(sglang.bootstrap_timeout.as_millis(), 500);
        assert_eq!(sglang.waiting_timeout.as_secs(), 2);
        assert!(c.validate().is_ok());
        let both =
            Cli::try_parse_from(["x", "--disaggregation-mode", "decode", "--role", "decode"])
                .expect("flags parse")
                .config();
        assert!(
            both.validate().is_err(),
            "vLLM's role and SGLang's mode exclude each other"
        );
        let zero = Cli::try_parse_from(["x", "--disaggregation-waiting-timeout", "0"])
            .expect("flags parse")
            .config();
        assert!(zero.validate().is_err());
        assert!(Cli::try_parse_from(["x", "--disaggregation-mode", "encode"]).is_err());
    }

    #[test]
    fn dp_ranks_map_to_config() {
        let c = Cli::try_parse_from(["x", "--dp-ranks", "2"]).expect("valid flags");
        assert_eq!(c.config().dp_ranks, 2);
        let c = Cli::try_parse_from(["x", "--data-parallel-size", "4"]).expect("vLLM's name");
        assert_eq!(c.config().dp_ranks, 4);
        assert!(Cli::try_parse_from(["x", "--dp-ranks", "0"]).is_err());
    }

    #[test]
    fn kv_event_flags_map_to_config() {
        let cli = Cli::try_parse_from([
            "x",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-topic",
            "kv-events",
            "--kv-events-encoding",
            "map",
            "--kv-events-hash",
            "bytes",
            "--kv-events-buffer-steps",
            "5",
        ])
        .expect("valid flags");
        let kv = cli.config().kv_events;
        assert_eq!(kv.endpoint.as_deref(), Some("tcp://127.0.0.1:0"));
        assert_eq!(kv.replay_endpoint.as_deref(), Some("tcp://127.0.0.1:0"));
        assert_eq!(kv.topic, "kv-events");
        assert_eq!(
            (kv.encoding, kv.hash, kv.buffer_steps),
            (KvEventEncoding::Map, KvEventHash::Bytes, 5)
        );
        let replay_alone = ["x", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"];
        assert!(Cli::try_parse_from(replay_alone).is_err());
        assert!(Cli::try_parse_from(["x", "--kv-events-hash", "hex"]).is_err());
    }

    #[test]
    fn offload_flags_map_to_config() {
        let c = Cli::try_parse_from([
            "x",
            "--offload-blocks",
            "96",
            "--offload-load-cost",
            "0.5",
            "--offload-events",
            "self-describing",
        ])
        .expect("valid flags")
        .config();
        assert_eq!(
            c.offload,
            OffloadConfig {
                blocks: 96,
                load_cost: 0.5,
                events: OffloadEvents::SelfDescribing,
            }
        );
        let c = Cli::try_parse_from(["x", "--offload-events", "placeholder"])
            .expect("valid flags")
            .config();
        assert_eq!(c.offload.events, OffloadEvents::Placeholder);
        for bad in [
            ["--offload-load-cost", "1.5"],
            ["--offload-load-cost", "-0.1"],
            ["--offload-load-cost", "NaN"],
            ["--offload-events", "full"],
            ["--offload-blocks", "-1"],
        ] {
            assert!(
                Cli::try_parse_from(["x", bad[0], bad[1]]).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn lora_flags_map_to_config() {
        let cli = Cli::try_parse_from([
            "x",
            "--lora-modules",
            "sql=/adapters/sql",
            r#"{"name": "chat", "path": "/adapters/chat", "base_model_name": "sim-model"}"#,
        ])
        .expect("valid flags");
        let c = cli.config();
        let modules: Vec<(&str, &str)> = c
            .lora_modules
            .iter()
            .map(|m| (m.name.as_str(), m.path.as_str()))
            .collect();
        assert_eq!(
            modules,
            [("sql", "/adapters/sql"), ("chat", "/adapters/chat")]
        );
        assert!(
            !c.enable_lora,
            "the flag stays off: the modules alone enable LoRA in the engine"
        );
        assert!(c.validate().is_ok());

        let c = Cli::try_parse_from(["x", "--enable-lora"])
            .expect("valid flags")
            .config();
        assert!(c.enable_lora && c.lora_modules.is_empty());

        // A repeated flag replaces the earlier list, as vLLM's argparse action does.
        let c = Cli::try_parse_from(["x", "--lora-modules", "a=/a", "--lora-modules", "b=/b"])
            .expect("valid flags")
            .config();
        assert_eq!(c.lora_modules.len(), 1);
        assert_eq!(c.lora_modules[0].name, "b");

        for bad in [
            "a=b=c",
            "not-json",
            r#"{"name": "a", "path": "/a", "rank": 8}"#,
        ] {
            assert!(
                Cli::try_parse_from(["x", "--lora-modules", bad]).is_err(),
                "{bad}"
            );
        }
        assert!(Cli::try_parse_from(["x", "--lora-modules"]).is_err());
    }
}

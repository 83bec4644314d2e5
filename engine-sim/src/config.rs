//! Engine knobs: [`SimConfig`] and its validation.

use std::path::PathBuf;
use std::time::Duration;

use crate::endpoint::TcpEndpoint;
use crate::error::SimError;
use crate::lora::{LoraModule, LoraRegistry};

/// Which running sequence gives its KV blocks back when decode runs out of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PreemptionMode {
    /// Preempt the most recently admitted running sequence (vLLM v1 default).
    #[default]
    Lifo,
    /// Preempt the earliest admitted running sequence.
    Fifo,
}

/// How KV events are laid out on the wire (`--kv-events-encoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvEventEncoding {
    /// Legacy positional arrays (vLLM up to mid 2026), trailing nil fields omitted.
    Positional,
    /// One msgpack map per event with a `type` key (vLLM PR #42892 and later; what vLLM
    /// 0.32 sends).
    #[default]
    Map,
}

/// How block hashes are sent (`--kv-events-hash`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvEventHash {
    /// The u64 id of the engine hash (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).
    #[default]
    Int,
    /// The 32-byte SHA-256 digest as msgpack bin; its last 8 bytes big-endian are the int form.
    Bytes,
}

/// Which side of disaggregated serving an engine takes (`--role`), as vLLM's NixlConnector
/// `kv_role` does: a prefill engine answers requests asking it to keep their KV for a remote
/// decode (`do_remote_decode`), a decode engine pulls a remote prefill's KV
/// (`do_remote_prefill`); both serve plain requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Role {
    /// Produces and consumes KV (vLLM's `kv_both`).
    #[default]
    Both,
    /// Produces KV for decode engines (`kv_producer`).
    Prefill,
    /// Consumes KV from prefill engines (`kv_consumer`).
    Decode,
}

impl Role {
    /// Whether it keeps a prefill's KV for a remote decode.
    pub fn produces(self) -> bool {
        matches!(self, Self::Both | Self::Prefill)
    }

    /// Whether it pulls a remote prefill's KV.
    pub fn consumes(self) -> bool {
        matches!(self, Self::Both | Self::Decode)
    }

    /// `both`, `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// Which side of SGLang's disaggregated serving an engine takes (`--disaggregation-mode`,
/// SGLang's flag and values: `python/sglang/srt/server_args.py`, `disaggregation_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DisaggregationMode {
    /// Not disaggregated (SGLang's default `null`).
    #[default]
    Null,
    /// Prefill only: runs a bootstrap server; a request waits in its bootstrap room until
    /// the decode engine joined, prefills, and answers once that engine has its KV.
    Prefill,
    /// Decode only: a request joins its room on the prefill engine's bootstrap server,
    /// receives the prompt's KV and decodes.
    Decode,
}

impl DisaggregationMode {
    /// `null`, `prefill` or `decode`, as SGLang's `/get_server_info` reports it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// SGLang's disaggregated serving (`--disaggregation-mode`): both legs of a request arrive at
/// once, with `bootstrap_host`, `bootstrap_port` and `bootstrap_room`, and meet in that room
/// of the prefill engine's bootstrap server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SglangDisaggregation {
    /// The engine's side; `Null`: off.
    pub mode: DisaggregationMode,
    /// Where a prefill engine's bootstrap server listens (engine `i` of a process: the port
    /// plus `i`; 0 picks a free port); what a decode leg without `bootstrap_port` contacts.
    pub bootstrap_port: u16,
    /// How long a prefill leg waits for its decode engine to join the room (SGLang's
    /// `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, 300 s by default there).
    pub bootstrap_timeout: Duration,
    /// How long a decode leg waits for the room's KV once it joined (SGLang's
    /// `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s by default there).
    pub waiting_timeout: Duration,
}

impl Default for SglangDisaggregation {
    fn default() -> Self {
        Self {
            mode: DisaggregationMode::Null,
            bootstrap_port: DEFAULT_BOOTSTRAP_PORT,
            bootstrap_timeout: Duration::from_secs(30),
            waiting_timeout: Duration::from_secs(30),
        }
    }
}

/// The KV shape of the served model, for the bytes a block transfer moves: per token
/// `layers × 2 (K and V) × kv_heads × head_dim × dtype_bytes`. The default is Qwen3-8B's
/// (36 layers, 8 KV heads of 128, bf16): 147,456 bytes per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Transformer layers.
    pub layers: usize,
    /// KV heads per layer (grouped-query attention).
    pub kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Bytes per KV element (2: bf16 / fp16, 1: fp8).
    pub dtype_bytes: usize,
}

impl Default for ModelShape {
    fn default() -> Self {
        Self {
            layers: 36,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
        }
    }
}

impl ModelShape {
    /// KV bytes of one token.
    pub fn bytes_per_token(&self) -> u64 {
        [
            self.layers,
            2,
            self.kv_heads,
            self.head_dim,
            self.dtype_bytes,
        ]
        .iter()
        .map(|&n| n as u64)
        .product()
    }
}

/// How transfers on an engine's inbound link slow its iterations (`--kv-transfer-interference-scaling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum InterferenceScaling {
    /// `interference` while any transfer runs, however many: the link's bandwidth is what
    /// the GPU loses, and it is used in full as soon as one transfer runs.
    #[default]
    Any,
    /// `interference` per transfer in flight: each transfer's reads are posted and polled in
    /// the engine's step and its writes contend with decoding, so a burst of concurrent
    /// transfers slows every iteration more than the same bytes one after another.
    PerTransfer,
}

/// Disaggregated serving: the role, how long a prefill's KV waits to be read, and the link
/// model of KV transfers.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTransferConfig {
    /// Which side of the protocol the engine takes.
    pub role: Role,
    /// How long a prefill engine keeps a request's blocks for a decode engine to read; then
    /// they are freed (vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480 s, is the upper bound).
    pub hold_timeout: Duration,
    /// The model's KV shape (bytes per block transferred).
    pub shape: ModelShape,
    /// Bandwidth of the engine's inbound KV link, in GB/s (10⁹ bytes); concurrent transfers
    /// share it equally. Default 64 (Dynamo's mocker).
    pub link_gbps: f64,
    /// How much slower a decode iteration runs while KV flows in (0.3: 30 % longer): the copy
    /// engines and memory bandwidth the transfer takes from the GPU.
    pub interference: f64,
    /// Whether `interference` applies once or per transfer in flight.
    pub interference_scaling: InterferenceScaling,
    /// The host decode engines reach this engine's held blocks at (`remote_host`; vLLM's
    /// `VLLM_NIXL_SIDE_CHANNEL_HOST`); `None`: the bound IP (127.0.0.1 when bound to every
    /// interface).
    pub side_channel_host: Option<String>,
    /// SGLang's protocol (bootstrap rooms) instead of vLLM's; needs `role: Both`.
    pub sglang: SglangDisaggregation,
}

impl Default for KvTransferConfig {
    fn default() -> Self {
        Self {
            role: Role::Both,
            hold_timeout: Duration::from_secs(30),
            shape: ModelShape::default(),
            link_gbps: 64.0,
            interference: 0.3,
            interference_scaling: InterferenceScaling::Any,
            side_channel_host: None,
            sglang: SglangDisaggregation::default(),
        }
    }
}

impl KvTransferConfig {
    fn validate(&self) -> Result<(), SimError> {
        let shape = &self.shape;
        if [
            shape.layers,
            shape.kv_heads,
            shape.head_dim,
            shape.dtype_bytes,
        ]
        .contains(&0)
        {
            return Err(SimError::InvalidConfig(
                "kv_transfer.shape: every dimension must be at least 1".to_owned(),
            ));
        }
        if !(self.link_gbps.is_finite() && self.link_gbps > 0.0) {
            return Err(SimError::InvalidConfig(
                "kv_transfer.link_gbps must be a positive number".to_owned(),
            ));
        }
        if !(self.interference.is_finite() && self.interference >= 0.0) {
            return Err(SimError::InvalidConfig(
                "kv_transfer.interference must be 0 or more".to_owned(),
            ));
        }
        if self.hold_timeout.is_zero() {
            return Err(SimError::InvalidConfig(
                "kv_transfer.hold_timeout must be positive".to_owned(),
            ));
        }
        let sglang = &self.sglang;
        if sglang.mode != DisaggregationMode::Null && self.role != Role::Both {
            return Err(SimError::InvalidConfig(format!(
                "--role {} (vLLM's protocol) and --disaggregation-mode {} (SGLang's) exclude each other",
                self.role.as_str(),
                sglang.mode.as_str()
            )));
        }
        if sglang.bootstrap_timeout.is_zero() || sglang.waiting_timeout.is_zero() {
            return Err(SimError::InvalidConfig(
                "kv_transfer.sglang: the bootstrap and waiting timeouts must be positive"
                    .to_owned(),
            ));
        }
        Ok(())
    }
}

/// What a block offloaded to the host-memory tier announces (`--offload-events`), as vLLM's
/// OffloadingConnector does with and without `kv_connector_extra_config`
/// `self_describing_kv_events: true`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OffloadEvents {
    /// vLLM's default: `BlockStored{block_hashes: [h], parent_block_hash: None, token_ids: [],
    /// block_size: 0, medium: "CPU"}`, `h` the block's device hash; no LoRA fields.
    #[default]
    Placeholder,
    /// The block described in full: its hash, its parent's, its tokens, the device block size,
    /// the adapter's `lora_id` / `lora_name`, `medium: "CPU"`, and no `extra_keys`.
    SelfDescribing,
}

/// A host-memory KV tier behind the device cache, as vLLM's OffloadingConnector with its
/// CPU spec and one block per chunk: every block stored on the device is copied there too
/// (an LRU of `blocks` blocks), and admission loads the blocks after the device hit that it
/// holds instead of prefilling them. Off while `blocks` is 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OffloadConfig {
    /// Capacity of the host tier in blocks (`--offload-blocks`); 0: no tier.
    pub blocks: usize,
    /// What loading a token back from host memory costs, as a share of what prefilling it in
    /// the same iteration would (`--offload-load-cost`, 0..=1): 0 prices a host hit as a
    /// device hit, 1 as a recompute.
    pub load_cost: f64,
    /// The payload of the tier's `BlockStored` events.
    pub events: OffloadEvents,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        Self {
            blocks: 0,
            load_cost: 0.25,
            events: OffloadEvents::Placeholder,
        }
    }
}

impl OffloadConfig {
    fn validate(&self, prefix_caching: bool) -> Result<(), SimError> {
        if !(self.load_cost.is_finite() && (0.0..=1.0).contains(&self.load_cost)) {
            return Err(SimError::InvalidConfig(
                "offload.load_cost must be between 0 and 1".to_owned(),
            ));
        }
        if self.blocks > 0 && !prefix_caching {
            return Err(SimError::InvalidConfig(
                "offload.blocks needs prefix caching: the host tier is keyed by block hashes"
                    .to_owned(),
            ));
        }
        Ok(())
    }
}

/// KV event publishing over ZMQ in vLLM's wire format. Off while `endpoint` is `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// PUB socket address, `tcp://HOST:PORT` (`*` binds every interface; port 0 picks a free
    /// port). Engine core `k` of a process (engine `i`'s rank `r`: `i * dp_ranks + r`) binds
    /// `PORT + k`. The engine always binds.
    pub endpoint: Option<String>,
    /// ROUTER socket answering replay requests, same form and offset rule; needs `endpoint`.
    pub replay_endpoint: Option<String>,
    /// First frame of every message.
    pub topic: String,
    /// Event layout.
    pub encoding: KvEventEncoding,
    /// Block hash form.
    pub hash: KvEventHash,
    /// Past batches kept for replay.
    pub buffer_steps: usize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            endpoint: None,
            replay_endpoint: None,
            topic: String::new(),
            encoding: KvEventEncoding::Map,
            hash: KvEventHash::Int,
            buffer_steps: 10_000,
        }
    }
}

impl KvEventsConfig {
    fn validate(&self) -> Result<(), SimError> {
        let invalid = |field: &str, e: String| SimError::InvalidConfig(format!("{field}: {e}"));
        if let Some(endpoint) = &self.endpoint {
            TcpEndpoint::parse(endpoint).map_err(|e| invalid("kv_events.endpoint", e))?;
        }
        match (&self.replay_endpoint, &self.endpoint) {
            (Some(_), None) => {
                return Err(SimError::InvalidConfig(
                    "kv_events.replay_endpoint needs kv_events.endpoint".to_owned(),
                ));
            }
            (Some(replay), Some(_)) => {
                TcpEndpoint::parse(replay).map_err(|e| invalid("kv_events.replay_endpoint", e))?;
            }
            (None, _) => {}
        }
        if self.buffer_steps == 0 {
            return Err(SimError::InvalidConfig(
                "kv_events.buffer_steps must be at least 1".to_owned(),
            ));
        }
        Ok(())
    }
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
    /// Report the prompt tokens served from the prefix cache in
    /// `usage.prompt_tokens_details.cached_tokens` (vLLM's `--enable-prompt-tokens-details`).
    pub prompt_tokens_details: bool,
    /// Which sequence to preempt when decode runs out of KV blocks.
    pub preemption_mode: PreemptionMode,
    /// Path to a Hugging Face `tokenizer.json`; `None` uses the built-in fallback tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// Length of the vectors `/v1/embeddings` returns.
    pub embedding_dim: usize,
    /// KV event publishing over ZMQ.
    pub kv_events: KvEventsConfig,
    /// Disaggregated serving: role and KV transfer model.
    pub kv_transfer: KvTransferConfig,
    /// Serve LoRA adapters (vLLM's `--enable-lora`): without it, and without
    /// [`Self::lora_modules`], `POST /v1/load_lora_adapter` is refused.
    pub enable_lora: bool,
    /// Adapters loaded at start (vLLM's `--lora-modules`), ids 1, 2, ... in order; any enables
    /// LoRA.
    pub lora_modules: Vec<LoraModule>,
    /// Test hook: every generation request is answered with this status and an OpenAI-shaped
    /// error body (an engine that keeps failing); `None`: served normally.
    pub fail_status: Option<u16>,
    /// Test hook: the response head of every generation request waits this long (an engine
    /// slow to its first byte).
    pub head_delay: Duration,
    /// Data-parallel ranks behind the one HTTP server (vLLM's `--data-parallel-size`): each
    /// rank is an engine core of its own (KV cache, scheduler, KV event sockets at the
    /// configured ports plus its rank); a request's `X-data-parallel-rank` header picks one,
    /// else vLLM's DP load balancer does.
    pub dp_ranks: usize,
    /// The host-memory tier behind the KV cache (vLLM's OffloadingConnector); off by default.
    pub offload: OffloadConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "sim-model".to_owned(),
            // GPU vLLM's default block size.
            block_size: 16,
            num_gpu_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8_192,
            max_model_len: 131_072,
            speedup_ratio: 1.0,
            decode_speedup_ratio: 1.0,
            no_delay: false,
            enable_prefix_caching: true,
            prompt_tokens_details: false,
            preemption_mode: PreemptionMode::Lifo,
            tokenizer: None,
            embedding_dim: 16,
            kv_events: KvEventsConfig::default(),
            kv_transfer: KvTransferConfig::default(),
            enable_lora: false,
            lora_modules: Vec::new(),
            fail_status: None,
            head_delay: Duration::ZERO,
            dp_ranks: 1,
            offload: OffloadConfig::default(),
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
            ("dp_ranks", self.dp_ranks),
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
        LoraRegistry::new(self.enable_lora, &self.lora_modules)
            .map_err(|e| SimError::InvalidConfig(format!("lora_modules: {e}")))?;
        self.kv_transfer.validate()?;
        self.offload.validate(self.enable_prefix_caching)?;
        self.kv_events.validate()
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
        // GPU vLLM's defaults: 16-token blocks, events as maps (what vLLM 0.32 sends).
        assert_eq!(c.block_size, 16);
        assert_eq!(c.kv_events.encoding, KvEventEncoding::Map);
        assert_eq!(c.num_gpu_blocks, 16_384);
        assert_eq!(c.max_num_seqs, 256);
        assert_eq!(c.max_num_batched_tokens, 8_192);
        assert_eq!(c.max_model_len, 131_072);
        assert_eq!(c.preemption_mode, PreemptionMode::Lifo);
        assert!(c.enable_prefix_caching && !c.no_delay);
        assert_eq!(c.embedding_dim, 16);
        assert_eq!(c.kv_events, KvEventsConfig::default());
        assert_eq!(c.kv_events.buffer_steps, 10_000);
        assert!(c.kv_events.endpoint.is_none() && c.kv_events.topic.is_empty());
        assert!(!c.enable_lora && c.lora_modules.is_empty());
        assert!(c.validate().is_ok());
    }

    #[test]
    fn lora_modules_are_checked() {
        let with = |names: &[&str]| SimConfig {
            lora_modules: names
                .iter()
                .map(|n| LoraModule {
                    name: (*n).to_owned(),
                    path: format!("/adapters/{n}"),
                })
                .collect(),
            ..SimConfig::default()
        };
        assert!(with(&["a", "b"]).validate().is_ok());
        let twice = with(&["a", "a"]).validate().map_err(|e| e.to_string());
        assert_eq!(
            twice,
            Err(
                "invalid engine configuration: lora_modules: The lora adapter 'a' has already \
                 been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
                    .to_owned()
            )
        );
        assert!(with(&[""]).validate().is_err());
    }

    #[test]
    fn kv_event_endpoints_are_checked() {
        let with = |endpoint: Option<&str>, replay: Option<&str>| SimConfig {
            kv_events: KvEventsConfig {
                endpoint: endpoint.map(str::to_owned),
                replay_endpoint: replay.map(str::to_owned),
                ..KvEventsConfig::default()
            },
            ..SimConfig::default()
        };
        assert!(
            with(Some("tcp://127.0.0.1:0"), Some("tcp://*:6557"))
                .validate()
                .is_ok()
        );
        assert!(with(None, Some("tcp://127.0.0.1:0")).validate().is_err());
        assert!(with(Some("ipc:///tmp/x"), None).validate().is_err());
        assert!(
            with(Some("tcp://127.0.0.1:0"), Some("tcp://nohost"))
                .validate()
                .is_err()
        );
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
    fn the_default_shape_is_qwen3_8b_and_transfers_are_checked() {
        let c = KvTransferConfig::default();
        assert_eq!(c.shape.bytes_per_token(), 36 * 2 * 8 * 128 * 2);
        assert_eq!(c.role, Role::Both);
        assert!(Role::Both.produces() && Role::Both.consumes());
        assert!(Role::Prefill.produces() && !Role::Prefill.consumes());
        assert!(!Role::Decode.produces() && Role::Decode.consumes());
        for bad in [
            KvTransferConfig {
                link_gbps: 0.0,
                ..c.clone()
            },
            KvTransferConfig {
                interference: -1.0,
                ..c.clone()
            },
            KvTransferConfig {
                shape: ModelShape {
                    layers: 0,
                    ..c.shape
                },
                ..c.clone()
            },
            KvTransferConfig {
                hold_timeout: Duration::ZERO,
                ..c.clone()
            },
        ] {
            let config = SimConfig {
                kv_transfer: bad,
                ..SimConfig::default()
            };
            assert!(config.validate().is_err(), "{config:?}");
        }
    }

    #[test]
    fn the_host_tier_is_off_by_default_and_checked() {
        let c = SimConfig::default();
        assert_eq!(
            c.offload,
            OffloadConfig {
                blocks: 0,
                load_cost: 0.25,
                events: OffloadEvents::Placeholder,
            }
        );
        let with = |blocks: usize, load_cost: f64, prefix_caching: bool| SimConfig {
            offload: OffloadConfig {
                blocks,
                load_cost,
                ..OffloadConfig::default()
            },
            enable_prefix_caching: prefix_caching,
            ..SimConfig::default()
        };
        for cost in [0.0, 0.25, 1.0] {
            assert!(with(96, cost, true).validate().is_ok(), "{cost}");
        }
        for cost in [-0.01, 1.01, f64::NAN, f64::INFINITY] {
            assert!(with(96, cost, true).validate().is_err(), "{cost}");
        }
        assert!(with(96, 0.25, false).validate().is_err());
        assert!(with(0, 0.25, false).validate().is_ok());
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

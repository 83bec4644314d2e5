//! The agent's settings (from the CLI, or built by an embedding program such as the demo).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use kvmesh_control::{InstanceId, InstanceRole, Namespace};
use kvmesh_engine_events::Layout;

use crate::sidecar::pacer::PacerSettings;
use kvmesh_telemetry::TraceSettings;

/// Which engine the agent sits beside: decides how its KV events are read (vLLM's and SGLang's
/// ZMQ batches, each with its positional layout; TensorRT-LLM's polled JSON) and the metric
/// names scraped for load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EngineKind {
    /// vLLM.
    #[default]
    Vllm,
    /// SGLang.
    Sglang,
    /// TensorRT-LLM's `trtllm-serve`: its KV cache events are polled from
    /// `POST /kv_cache_events` (JSON), not read from ZMQ.
    Trtllm,
}

impl EngineKind {
    /// The positional layout of its KV events (TensorRT-LLM's are JSON, read by the poller:
    /// vLLM's layout is given but not used).
    pub fn layout(self) -> Layout {
        match self {
            Self::Vllm | Self::Trtllm => Layout::Vllm,
            Self::Sglang => Layout::Sglang,
        }
    }

    /// Tokens per KV block when neither `--block-size` nor the engine says: vLLM's and
    /// SGLang's 16 (the agent's long-standing default), TensorRT-LLM's `tokens_per_block`
    /// default, 32.
    pub fn default_block_size(self) -> usize {
        match self {
            Self::Vllm | Self::Sglang => 16,
            Self::Trtllm => 32,
        }
    }
}

/// Everything an agent needs to run.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// Base URL of the engine's HTTP API (health, metrics), e.g. `http://127.0.0.1:8000`.
    pub engine_url: String,
    /// The URL the proxy should use for the engine (default: `engine_url`).
    pub advertise_url: Option<String>,
    /// The served model name.
    pub model: String,
    /// The engine's KV event PUB endpoint (rank 0), e.g. `tcp://127.0.0.1:5557`; rank r uses
    /// port + r. A `*` host (vLLM's bind form) means 127.0.0.1.
    pub kv_events_endpoint: String,
    /// The engine's replay ROUTER endpoint (rank 0), if it has one.
    pub kv_events_replay_endpoint: Option<String>,
    /// ZMQ subscription prefix (the engine's `topic`).
    pub kv_events_topic: String,
    /// Ask the engine where its KV event publishers are (vLLM's `GET /kv_event_sources`: per
    /// data-parallel rank, the PUB and replay endpoints and the topic) instead of using
    /// `kv_events_endpoint` and `kv_events_replay_endpoint`, which still serve an engine
    /// without that route (404: a vLLM older than 0.32).
    pub discover_kv_events: bool,
    /// With `discover_kv_events`: take `dp_ranks` from the ranks the engine lists.
    pub dp_ranks_from_engine: bool,
    /// How often TensorRT-LLM's `POST /kv_cache_events` is polled (engine kind `trtllm`).
    pub kv_events_poll_interval: Duration,
    /// vLLM, SGLang or TensorRT-LLM.
    pub engine_kind: EngineKind,
    /// Tokens per KV block; must equal the engine's (`None`: the engine's, as it states it,
    /// else [`EngineKind::default_block_size`]).
    pub block_size: Option<usize>,
    /// KV cache capacity in blocks (0: the engine's, as it states it, else unknown).
    pub total_blocks: u64,
    /// Data-parallel ranks (one event socket each).
    pub dp_ranks: u32,
    /// Labels copied into the instance record.
    pub labels: BTreeMap<String, String>,
    /// Its side of disaggregated serving, for the record.
    pub role: InstanceRole,
    /// Control-plane namespace.
    pub namespace: Namespace,
    /// Lease TTL of the instance record.
    pub lease_ttl: Duration,
    /// How often the engine's `/metrics` are scraped into a load report.
    pub load_interval: Duration,
    /// How often the engine's `/health` is polled.
    pub health_interval: Duration,
    /// How long to stay registered as `draining` on shutdown before deregistering.
    pub drain: Duration,
    /// Where the agent's own `/health` and `/metrics` listen (port 0: pick one).
    pub listen: SocketAddr,
    /// The instance id (default: random).
    pub instance_id: InstanceId,
    /// How long start-up may take (engine sockets connected, first registration).
    pub startup_timeout: Duration,
    /// Where spans go (`None`: tracing off).
    pub tracing: Option<TraceSettings>,
    /// The inbound sidecar in front of the engine (`None`: off; proxies reach the engine
    /// directly).
    pub inbound: Option<InboundConfig>,
}

/// The agent as the pod's inbound sidecar.
#[derive(Debug, Clone, PartialEq)]
pub struct InboundConfig {
    /// Where it listens; the instance is registered at this address (unless
    /// `advertise_url` says otherwise).
    pub listen: SocketAddr,
    /// KV bytes of one token (`layers × 2 × kv_heads × head_dim × dtype_bytes`; Qwen3-8B in
    /// bf16: 147,456): a decode leg's transfer moves `blocks × block_size ×` this.
    pub kv_bytes_per_token: u64,
    /// The transfer budget (`None`: decode legs are forwarded unpaced).
    pub pacing: Option<PacerSettings>,
    /// Pace at the GPUs' measured host-to-device bandwidth instead of `pacing`'s rate, when
    /// the `cuda` feature finds a GPU.
    pub measured_rate: bool,
}

impl AgentConfig {
    /// A configuration with every default, for `model` served at `engine_url` publishing
    /// events at `kv_events_endpoint`.
    pub fn new(engine_url: &str, model: &str, kv_events_endpoint: &str) -> Self {
        Self {
            engine_url: engine_url.trim_end_matches('/').to_owned(),
            advertise_url: None,
            model: model.to_owned(),
            kv_events_endpoint: kv_events_endpoint.to_owned(),
            kv_events_replay_endpoint: None,
            kv_events_topic: String::new(),
            discover_kv_events: false,
            dp_ranks_from_engine: false,
            kv_events_poll_interval: Duration::from_millis(100),
            engine_kind: EngineKind::Vllm,
            block_size: None,
            total_blocks: 0,
            dp_ranks: 1,
            labels: BTreeMap::new(),
            role: InstanceRole::Both,
            namespace: Namespace::default(),
            lease_ttl: Duration::from_secs(10),
            load_interval: Duration::from_millis(250),
            health_interval: Duration::from_secs(1),
            drain: Duration::from_secs(5),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            instance_id: InstanceId::random(),
            startup_timeout: Duration::from_secs(60),
            tracing: None,
            inbound: None,
        }
    }
}

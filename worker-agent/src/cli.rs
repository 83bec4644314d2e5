//! Command-line flags (each also read from a `KVMESH_AGENT_*` environment variable).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kvmesh_control::{
    DurableStream, EtcdAuth, EtcdSettings, InstanceId, InstanceRole, Namespace, NatsAuth,
    NatsSettings, TlsFiles,
};
use kvmesh_telemetry::TraceSettings;

use crate::config::{AgentConfig, EngineKind, InboundConfig};
use crate::sidecar::pacer::PacerSettings;

/// `--pace-rate-gbps` when neither given nor measured.
const DEFAULT_PACE_RATE_GBPS: f64 = 25.0;
/// The KV event PUB endpoint when `--kv-events-endpoint` is not given and the engine does not
/// say (vLLM's default, seen from beside the engine).
const DEFAULT_KV_EVENTS_ENDPOINT: &str = "tcp://127.0.0.1:5557";

/// Parses `250ms`, `10s`, `1.5s`, `2m`, `1h` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("invalid duration {s:?} (try 250ms, 10s, 2m)"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(format!("invalid duration unit in {s:?} (ms, s, m or h)")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("invalid duration {s:?}"))
}

/// Parses `k=v,k2=v2` (empty: no labels).
pub fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
            _ => Err(format!("label {pair:?} is not key=value")),
        })
        .collect()
}

/// Parses a factor: a finite number, 0 or more.
fn parse_factor(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(factor) if factor.is_finite() && factor >= 0.0 => Ok(factor),
        _ => Err(format!("invalid factor {s:?} (a number, 0 or more)")),
    }
}

/// Parses a sampling ratio, 0 to 1.
fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
        _ => Err(format!(
            "invalid ratio {s:?}: expected a number from 0 to 1"
        )),
    }
}

/// Parses an OTLP/gRPC endpoint, `http://HOST:PORT`.
fn parse_otlp_endpoint(s: &str) -> Result<String, String> {
    let port = s
        .strip_prefix("http://")
        .and_then(|authority| authority.trim_end_matches('/').rsplit_once(':'))
        .and_then(|(host, port)| (!host.is_empty()).then_some(port));
    match port.map(str::parse::<u16>) {
        Some(Ok(port)) if port > 0 => Ok(s.to_owned()),
        _ => Err(format!(
            "invalid OTLP endpoint {s:?}: expected http://HOST:PORT (plaintext OTLP/gRPC)"
        )),
    }
}

fn parse_namespace(s: &str) -> Result<Namespace, String> {
    Namespace::new(s).map_err(|e| e.to_string())
}

fn parse_instance_id(s: &str) -> Result<InstanceId, String> {
    s.parse()
        .map_err(|e: kvmesh_control::ControlError| e.to_string())
}

/// kvmesh worker-agent: registers the engine beside it in etcd, turns its KV events into
/// kvmesh's hash space and publishes them on NATS, and reports its load.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvmesh-agent", version, about)]
pub struct Cli {
    /// Base URL of the engine's HTTP API.
    #[arg(
        long,
        env = "KVMESH_AGENT_ENGINE_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub engine_url: String,
    /// URL the proxy should use for the engine (default: --engine-url).
    #[arg(long, env = "KVMESH_AGENT_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// Served model name (as clients send it).
    #[arg(long, env = "KVMESH_AGENT_MODEL")]
    pub model: String,
    /// The engine's KV event PUB endpoint (rank 0; rank r uses port + r). Without it, an agent
    /// beside vLLM asks the engine's `GET /kv_event_sources` (each rank's PUB and replay
    /// endpoints); other engines, and a vLLM without that route, use `tcp://127.0.0.1:5557`.
    #[arg(long, env = "KVMESH_AGENT_KV_EVENTS_ENDPOINT")]
    pub kv_events_endpoint: Option<String>,
    /// The engine's KV event replay ROUTER endpoint (rank 0), if configured.
    #[arg(long, env = "KVMESH_AGENT_KV_EVENTS_REPLAY_ENDPOINT")]
    pub kv_events_replay_endpoint: Option<String>,
    /// The engine's KV event topic (subscription prefix).
    #[arg(long, env = "KVMESH_AGENT_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,
    /// Engine kind.
    #[arg(long, env = "KVMESH_AGENT_ENGINE_KIND", value_enum, default_value_t = EngineKind::Vllm)]
    pub engine_kind: EngineKind,
    /// How often TensorRT-LLM's `POST /kv_cache_events` is polled (`--engine-kind trtllm`).
    #[arg(long, env = "KVMESH_AGENT_KV_EVENTS_POLL_INTERVAL", default_value = "100ms", value_parser = parse_duration)]
    pub kv_events_poll_interval: Duration,
    /// Tokens per KV block; must equal the engine's (default: the engine's, read from its
    /// `vllm:cache_config_info`, SGLang server info or TensorRT-LLM's
    /// `trtllm_kv_cache_tokens_per_block`, else 16, and 32 for TensorRT-LLM).
    #[arg(long, env = "KVMESH_AGENT_BLOCK_SIZE")]
    pub block_size: Option<usize>,
    /// KV cache capacity in blocks (0: the engine's, read as the block size is, else unknown).
    #[arg(long, env = "KVMESH_AGENT_TOTAL_BLOCKS", default_value_t = 0)]
    pub total_blocks: u64,
    /// Data-parallel ranks (default: the ranks vLLM's `/kv_event_sources` lists when the
    /// agent asks it, else 1).
    #[arg(long, env = "KVMESH_AGENT_DP_RANKS")]
    pub dp_ranks: Option<u32>,
    /// The engine's side of disaggregated serving, registered in its record: `prefill`
    /// (prefill legs only), `decode` (decode legs and whole requests) or `both`.
    #[arg(long, env = "KVMESH_AGENT_ROLE", default_value = "both", value_parser = ["both", "prefill", "decode"])]
    pub role: String,
    /// Labels of the instance record, `k=v,k2=v2`.
    #[arg(long, env = "KVMESH_AGENT_LABELS", default_value = "", value_parser = parse_labels)]
    pub labels: BTreeMap<String, String>,
    /// Control-plane namespace.
    #[arg(long, env = "KVMESH_AGENT_NAMESPACE", default_value = "kvmesh", value_parser = parse_namespace)]
    pub namespace: Namespace,
    /// etcd client URL (`http://`, or `https://` with --etcd-ca-file), or the members of one
    /// cluster separated by commas.
    #[arg(long, env = "KVMESH_AGENT_ETCD")]
    pub etcd: String,
    /// PEM CA that signs etcd's members (turns TLS on; endpoints are then `https://`).
    #[arg(long, env = "KVMESH_AGENT_ETCD_CA_FILE")]
    pub etcd_ca_file: Option<PathBuf>,
    /// PEM client certificate for etcd's --client-cert-auth (with --etcd-key-file).
    #[arg(long, env = "KVMESH_AGENT_ETCD_CERT_FILE", requires_all = ["etcd_key_file", "etcd_ca_file"])]
    pub etcd_cert_file: Option<PathBuf>,
    /// PEM private key of --etcd-cert-file.
    #[arg(long, env = "KVMESH_AGENT_ETCD_KEY_FILE", requires = "etcd_cert_file")]
    pub etcd_key_file: Option<PathBuf>,
    /// etcd user (auth enabled), with --etcd-password-file.
    #[arg(long, env = "KVMESH_AGENT_ETCD_USER", requires = "etcd_password_file")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password.
    #[arg(long, env = "KVMESH_AGENT_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    pub etcd_password_file: Option<PathBuf>,
    /// NATS server URLs, comma-separated (`nats://host:4222`, `tls://host:4222`).
    #[arg(long, env = "KVMESH_AGENT_NATS")]
    pub nats: String,
    /// PEM CA that signs the NATS server's certificate (turns TLS on).
    #[arg(long, env = "KVMESH_AGENT_NATS_CA_FILE")]
    pub nats_ca_file: Option<PathBuf>,
    /// PEM client certificate for NATS (with --nats-key-file; turns TLS on).
    #[arg(long, env = "KVMESH_AGENT_NATS_CERT_FILE", requires = "nats_key_file")]
    pub nats_cert_file: Option<PathBuf>,
    /// PEM private key of --nats-cert-file.
    #[arg(long, env = "KVMESH_AGENT_NATS_KEY_FILE", requires = "nats_cert_file")]
    pub nats_key_file: Option<PathBuf>,
    /// File holding a NATS token.
    #[arg(long, env = "KVMESH_AGENT_NATS_TOKEN_FILE", conflicts_with_all = ["nats_user", "nats_nkey_seed_file", "nats_creds_file"])]
    pub nats_token_file: Option<PathBuf>,
    /// NATS user, with --nats-password-file.
    #[arg(long, env = "KVMESH_AGENT_NATS_USER", requires = "nats_password_file", conflicts_with_all = ["nats_nkey_seed_file", "nats_creds_file"])]
    pub nats_user: Option<String>,
    /// File holding the NATS user's password.
    #[arg(long, env = "KVMESH_AGENT_NATS_PASSWORD_FILE", requires = "nats_user")]
    pub nats_password_file: Option<PathBuf>,
    /// File holding a NATS NKey seed (`SU...`).
    #[arg(
        long,
        env = "KVMESH_AGENT_NATS_NKEY_SEED_FILE",
        conflicts_with = "nats_creds_file"
    )]
    pub nats_nkey_seed_file: Option<PathBuf>,
    /// A NATS `.creds` file (user JWT and NKey seed).
    #[arg(long, env = "KVMESH_AGENT_NATS_CREDS_FILE")]
    pub nats_creds_file: Option<PathBuf>,
    /// Publish KV events through this JetStream stream (made when missing; the proxy's
    /// `events.jetstream.stream`): each batch is stored before the next goes, across NATS
    /// outages.
    #[arg(long, env = "KVMESH_AGENT_NATS_JETSTREAM_STREAM")]
    pub nats_jetstream_stream: Option<String>,
    /// How long the stream keeps a batch, when this agent makes it.
    #[arg(long, env = "KVMESH_AGENT_NATS_JETSTREAM_MAX_AGE", default_value = "1h", value_parser = parse_duration)]
    pub nats_jetstream_max_age: Duration,
    /// How often the NATS client PINGs a server that sends nothing else; a server that hangs
    /// without closing the connection is given up (and reconnected to) within three of these.
    #[arg(long, env = "KVMESH_AGENT_NATS_PING_INTERVAL", default_value = "2s", value_parser = parse_duration)]
    pub nats_ping_interval: Duration,
    /// Lease TTL of the instance record.
    #[arg(long, env = "KVMESH_AGENT_LEASE_TTL", default_value = "10s", value_parser = parse_duration)]
    pub lease_ttl: Duration,
    /// Engine /metrics scrape interval for load reports.
    #[arg(long, env = "KVMESH_AGENT_LOAD_INTERVAL", default_value = "250ms", value_parser = parse_duration)]
    pub load_interval: Duration,
    /// Engine /health poll interval.
    #[arg(long, env = "KVMESH_AGENT_HEALTH_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub health_interval: Duration,
    /// How long to advertise `draining` on SIGTERM before deregistering.
    #[arg(long, env = "KVMESH_AGENT_DRAIN", default_value = "5s", value_parser = parse_duration)]
    pub drain: Duration,
    /// Run as the pod's inbound sidecar on this address: every request is forwarded to the
    /// engine, decode legs paced (below), and the instance registered here (unless
    /// --advertise-url says otherwise).
    #[arg(long, env = "KVMESH_AGENT_INBOUND_LISTEN")]
    pub inbound_listen: Option<SocketAddr>,
    /// KV bytes of one token (layers × 2 × kv_heads × head_dim × dtype bytes; the default is
    /// Qwen3-8B in bf16), for the bytes a decode leg's transfer moves.
    #[arg(
        long,
        env = "KVMESH_AGENT_KV_BYTES_PER_TOKEN",
        default_value_t = 147_456
    )]
    pub kv_bytes_per_token: u64,
    /// The pod's KV-transfer budget: bytes in flight at once (0, the default: decode legs
    /// unpaced; measured, pacing cost time to first token everywhere and helped running
    /// streams only on a slow link, docs/BENCHMARKS.md; 4294967296 is the budget measured
    /// best there).
    #[arg(
        long,
        env = "KVMESH_AGENT_PACE_MAX_INFLIGHT_BYTES",
        default_value_t = 0
    )]
    pub pace_max_inflight_bytes: u64,
    /// The pod's KV-transfer budget: link bandwidth given to transfers, GB/s (default: the
    /// GPUs' measured host-to-device bandwidth with the `cuda` feature, else 25).
    #[arg(long, env = "KVMESH_AGENT_PACE_RATE_GBPS")]
    pub pace_rate_gbps: Option<f64>,
    /// Longest a transfer waits before it goes next whatever its size.
    #[arg(long, env = "KVMESH_AGENT_PACE_MAX_WAIT", default_value = "250ms", value_parser = parse_duration)]
    pub pace_max_wait: Duration,
    /// A transfer counts as done this many times `bytes / --pace-rate-gbps` after its
    /// admission if the engine's first token has not come back by then (0: only the first
    /// token ends it).
    #[arg(long, env = "KVMESH_AGENT_PACE_HOLD_FACTOR", default_value_t = PacerSettings::DEFAULT_HOLD_FACTOR, value_parser = parse_factor)]
    pub pace_hold_factor: f64,
    /// Address of the agent's /health and /metrics (port 0: pick one).
    #[arg(long, env = "KVMESH_AGENT_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Instance id, 1-16 hex digits (default: random).
    #[arg(long, env = "KVMESH_AGENT_INSTANCE_ID", value_parser = parse_instance_id)]
    pub instance_id: Option<InstanceId>,
    /// How long start-up may take.
    #[arg(long, env = "KVMESH_AGENT_STARTUP_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub startup_timeout: Duration,
    /// Export spans (registration, each event batch's translation and publishing) to this
    /// OTLP/gRPC receiver, `http://HOST:PORT` (default: tracing off).
    #[arg(long, env = "KVMESH_AGENT_OTLP_ENDPOINT", value_parser = parse_otlp_endpoint)]
    pub otlp_endpoint: Option<String>,
    /// Share of traces recorded, 0 to 1 (with --otlp-endpoint).
    #[arg(long, env = "KVMESH_AGENT_TRACE_SAMPLING_RATIO", default_value_t = 1.0, value_parser = parse_ratio)]
    pub trace_sampling_ratio: f64,
}

impl Cli {
    /// The etcd client settings the flags describe.
    pub fn etcd_settings(&self) -> EtcdSettings {
        EtcdSettings {
            endpoints: self.etcd.clone(),
            tls: self.etcd_ca_file.as_ref().map(|ca| TlsFiles {
                ca_file: Some(ca.clone()),
                cert_file: self.etcd_cert_file.clone(),
                key_file: self.etcd_key_file.clone(),
            }),
            auth: self
                .etcd_user
                .clone()
                .zip(self.etcd_password_file.clone())
                .map(|(user, password_file)| EtcdAuth {
                    user,
                    password_file,
                }),
        }
    }

    /// The NATS client settings the flags describe; `name` shows in the server's list.
    pub fn nats_settings(&self, name: &str) -> NatsSettings {
        let tls =
            (self.nats_ca_file.is_some() || self.nats_cert_file.is_some()).then(|| TlsFiles {
                ca_file: self.nats_ca_file.clone(),
                cert_file: self.nats_cert_file.clone(),
                key_file: self.nats_key_file.clone(),
            });
        let auth = NatsAuth::first_of(
            self.nats_token_file.clone(),
            self.nats_user.clone().zip(self.nats_password_file.clone()),
            self.nats_nkey_seed_file.clone(),
            self.nats_creds_file.clone(),
        );
        NatsSettings {
            url: self.nats.clone(),
            name: name.to_owned(),
            tls,
            auth,
            durable: self
                .nats_jetstream_stream
                .as_ref()
                .map(|stream| DurableStream {
                    name: stream.clone(),
                    subjects: vec![self.namespace.all_events_subject()],
                    max_age: self.nats_jetstream_max_age,
                }),
            ping_interval: self.nats_ping_interval,
        }
    }

    /// The agent configuration the flags describe.
    pub fn config(&self) -> AgentConfig {
        let endpoint = self
            .kv_events_endpoint
            .as_deref()
            .unwrap_or(DEFAULT_KV_EVENTS_ENDPOINT);
        let mut config = AgentConfig::new(&self.engine_url, &self.model, endpoint);
        config.advertise_url = self.advertise_url.clone();
        config.kv_events_replay_endpoint = self.kv_events_replay_endpoint.clone();
        config.kv_events_topic = self.kv_events_topic.clone();
        config.discover_kv_events =
            self.kv_events_endpoint.is_none() && self.engine_kind == EngineKind::Vllm;
        config.dp_ranks_from_engine = self.dp_ranks.is_none();
        config.kv_events_poll_interval = self.kv_events_poll_interval;
        config.engine_kind = self.engine_kind;
        config.block_size = self.block_size;
        config.total_blocks = self.total_blocks;
        config.dp_ranks = self.dp_ranks.unwrap_or(1);
        config.labels = self.labels.clone();
        config.role = match self.role.as_str() {
            "prefill" => InstanceRole::Prefill,
            "decode" => InstanceRole::Decode,
            _ => InstanceRole::Both,
        };
        config.namespace = self.namespace.clone();
        config.lease_ttl = self.lease_ttl;
        config.load_interval = self.load_interval;
        config.health_interval = self.health_interval;
        config.drain = self.drain;
        config.listen = self.listen;
        config.inbound = self.inbound_listen.map(|listen| InboundConfig {
            listen,
            kv_bytes_per_token: self.kv_bytes_per_token,
            pacing: (self.pace_max_inflight_bytes > 0).then_some(PacerSettings {
                max_in_flight_bytes: self.pace_max_inflight_bytes,
                rate_bytes_per_sec: self.pace_rate_gbps.unwrap_or(DEFAULT_PACE_RATE_GBPS) * 1e9,
                max_wait: self.pace_max_wait,
                hold_factor: self.pace_hold_factor,
            }),
            measured_rate: self.pace_rate_gbps.is_none(),
        });
        if let Some(id) = self.instance_id {
            config.instance_id = id;
        }
        config.startup_timeout = self.startup_timeout;
        config.tracing = self.otlp_endpoint.as_ref().map(|endpoint| TraceSettings {
            otlp_endpoint: endpoint.clone(),
            sampling_ratio: self.trace_sampling_ratio,
            service_name: "kvmesh-agent".to_owned(),
            export_interval: Duration::from_secs(1),
            export_timeout: Duration::from_secs(10),
            max_queue_size: 2048,
        });
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_labels_parse() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        for bad in ["", "s", "10d", "-1s", "1e999s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        let labels = parse_labels("zone=a, gpu=h100").expect("labels");
        assert_eq!(labels.get("gpu").map(String::as_str), Some("h100"));
        assert!(parse_labels("").expect("none").is_empty());
        assert!(parse_labels("novalue").is_err());
    }

    #[test]
    fn flags_map_to_the_config() {
        let cli = Cli::try_parse_from([
            "kvmesh-agent",
            "--model",
            "org/m",
            "--etcd",
            "http://127.0.0.1:2379",
            "--nats",
            "nats://127.0.0.1:4222",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:5558",
            "--engine-kind",
            "sglang",
            "--dp-ranks",
            "2",
            "--labels",
            "zone=a",
            "--instance-id",
            "c0ffee",
            "--drain",
            "0s",
        ])
        .expect("valid flags");
        let c = cli.config();
        assert_eq!(c.model, "org/m");
        assert_eq!(c.engine_kind, EngineKind::Sglang);
        assert_eq!(
            (c.dp_ranks, c.block_size),
            (2, None),
            "the engine's, once it says"
        );
        assert_eq!(c.instance_id, InstanceId(0xc0ffee));
        assert_eq!(c.lease_ttl, Duration::from_secs(10));
        assert_eq!(c.load_interval, Duration::from_millis(250));
        assert_eq!(c.drain, Duration::ZERO);
        assert_eq!(
            c.kv_events_replay_endpoint.as_deref(),
            Some("tcp://127.0.0.1:5558")
        );
        assert!(Cli::try_parse_from(["kvmesh-agent", "--model", "m"]).is_err());
        assert!(
            Cli::try_parse_from([
                "kvmesh-agent",
                "--model",
                "m",
                "--etcd",
                "e",
                "--nats",
                "n",
                "--namespace",
                "a.b"
            ])
            .is_err()
        );
    }

    #[test]
    fn without_an_endpoint_vllm_is_asked_and_trtllm_is_polled() {
        let base = ["kvmesh-agent", "--model", "m", "--etcd", "e", "--nats", "n"];
        let parse = |extra: &[&str]| {
            Cli::try_parse_from(base.iter().chain(extra.iter()))
                .expect("valid flags")
                .config()
        };
        let asked = parse(&[]);
        assert!(asked.discover_kv_events && asked.dp_ranks_from_engine);
        assert_eq!(
            (asked.kv_events_endpoint.as_str(), asked.dp_ranks),
            (DEFAULT_KV_EVENTS_ENDPOINT, 1),
            "what an engine without /kv_event_sources gets"
        );
        let given = parse(&["--kv-events-endpoint", "tcp://h:1", "--dp-ranks", "2"]);
        assert!(!given.discover_kv_events && !given.dp_ranks_from_engine);
        assert_eq!(
            (given.kv_events_endpoint.as_str(), given.dp_ranks),
            ("tcp://h:1", 2)
        );
        assert!(!parse(&["--engine-kind", "sglang"]).discover_kv_events);
        let trtllm = parse(&[
            "--engine-kind",
            "trtllm",
            "--kv-events-poll-interval",
            "50ms",
        ]);
        assert_eq!(trtllm.engine_kind, EngineKind::Trtllm);
        assert!(!trtllm.discover_kv_events);
        assert_eq!(trtllm.kv_events_poll_interval, Duration::from_millis(50));
        assert_eq!(
            parse(&[]).kv_events_poll_interval,
            Duration::from_millis(100)
        );
    }

    #[test]
    fn tracing_flags_turn_tracing_on() {
        let base = ["kvmesh-agent", "--model", "m", "--etcd", "e", "--nats", "n"];
        let off = Cli::try_parse_from(base).expect("valid flags");
        assert_eq!(off.config().tracing, None);
        let on = Cli::try_parse_from(
            base.into_iter()
                .chain(["--otlp-endpoint", "http://127.0.0.1:4317"])
                .chain(["--trace-sampling-ratio", "0.25"]),
        )
        .expect("valid flags");
        let tracing = on.config().tracing.expect("tracing on");
        assert_eq!(tracing.otlp_endpoint, "http://127.0.0.1:4317");
        assert_eq!(tracing.sampling_ratio, 0.25);
        assert_eq!(tracing.service_name, "kvmesh-agent");
        for bad in [
            ["--otlp-endpoint", "127.0.0.1:4317"],
            ["--otlp-endpoint", "http://collector"],
            ["--otlp-endpoint", "http://:4317"],
            ["--trace-sampling-ratio", "1.5"],
            ["--trace-sampling-ratio", "x"],
        ] {
            assert!(
                Cli::try_parse_from(base.into_iter().chain(bad)).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn control_plane_tls_and_credentials_flags() {
        let base = [
            "kvmesh-agent",
            "--model",
            "m",
            "--etcd",
            "https://e:2379",
            "--nats",
            "tls://n:4222",
        ];
        let parse = |extra: &[&str]| Cli::try_parse_from(base.iter().chain(extra.iter()));
        let plain = parse(&[]).expect("no flags");
        assert_eq!(plain.etcd_settings().tls, None);
        assert_eq!(plain.nats_settings("a").auth, NatsAuth::None);
        let full = parse(&[
            "--etcd-ca-file",
            "ca.pem",
            "--etcd-cert-file",
            "c.pem",
            "--etcd-key-file",
            "k.pem",
            "--etcd-user",
            "agent",
            "--etcd-password-file",
            "pw",
            "--nats-ca-file",
            "nca.pem",
            "--nats-user",
            "agent",
            "--nats-password-file",
            "npw",
        ])
        .expect("valid flags");
        let etcd = full.etcd_settings();
        assert_eq!(
            etcd.tls.and_then(|tls| tls.key_file),
            Some(PathBuf::from("k.pem"))
        );
        assert_eq!(etcd.auth.map(|auth| auth.user), Some("agent".to_owned()));
        let nats = full.nats_settings("kvmesh-agent-1");
        assert_eq!(nats.name, "kvmesh-agent-1");
        assert!(nats.tls.is_some());
        assert_eq!(
            nats.auth,
            NatsAuth::UserPassword {
                user: "agent".to_owned(),
                password_file: PathBuf::from("npw")
            }
        );
        for bad in [
            &["--nats-token-file", "t", "--nats-creds-file", "c"][..],
            &["--nats-user", "u"],
            &["--nats-cert-file", "c.pem"],
            &["--etcd-cert-file", "c.pem", "--etcd-key-file", "k.pem"],
            &["--etcd-password-file", "pw"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}

//! `kvmesh-demo`: the whole kvmesh data plane on one machine, nothing to install.
//!
//! Starts simulated engines in-process (`kvmesh-engine-sim` as a library), each
//! publishing vLLM's KV event stream over ZMQ on loopback, one embedded worker-agent
//! per engine (`kvmesh-agent` as a library) and the proxy in front of them, with a
//! config built here and printed, then prints a ready-to-paste `curl` and serves
//! until Ctrl-C or SIGTERM. This launcher is the only place where the proxy meets
//! the simulator, so a production `kvmesh-proxy` build carries no simulator code.
//!
//! The agents register their engines in an in-process registry and publish the
//! engines' KV events, re-hashed into kvmesh's block hashes, on an in-process event
//! bus: the same `kvmesh-control` traits that etcd and NATS implement in a cluster.
//! The proxy (`discovery: in_process`, `events: in_process`) finds the engines there
//! and routes with `policy: kv` from what the engines really cache, using the real
//! Qwen3 tokenizer, which the simulated engines use too: every response carries
//! `x-kvmesh-route` and a conversation's turns land where its prefix is cached.
//!
//! With `--disaggregated`, half the engines prefill and half decode, each agent in front of
//! its engine as its inbound sidecar (pacing the decode engines' KV transfers): every
//! request runs its prefill leg on a prefill engine and its decode leg on a decode engine,
//! which pulls the KV over the simulator's link model; `x-kvmesh-route` names both.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use kvmesh_agent::sidecar::pacer::PacerSettings;
use kvmesh_agent::{AgentConfig, AgentHandle, InboundConfig};
use kvmesh_config::Config;
use kvmesh_control::{EventBus, InProcessBus, InProcessRegistry, InstanceRole, Registry};
use kvmesh_engine_sim::{EngineHandle, KvEventsConfig, KvTransferConfig, Role, SimConfig};
use kvmesh_proxy::{ControlPlane, Proxy};
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

/// Runs simulated engines behind kvmesh-proxy.
#[derive(Debug, Parser)]
#[command(name = "kvmesh-demo", version, about)]
struct Cli {
    /// Address of the proxy's OpenAI listener.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Address of the proxy's admin listener (/metrics, /health, /live).
    #[arg(long, default_value = "127.0.0.1:9090")]
    admin: SocketAddr,
    /// Address of the proxy's KServe v2 gRPC listener.
    #[arg(long, default_value = "127.0.0.1:8787")]
    grpc: SocketAddr,
    /// Number of simulated engines.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Model name the engines serve and the proxy routes.
    #[arg(long, default_value = "qwen3")]
    model: String,
    /// Simulated engine speed-up over the real-time timing model (1 = real time).
    #[arg(long, default_value_t = 1.0)]
    speedup_ratio: f64,
    /// Tokenizer directory (tokenizer.json + tokenizer_config.json) for the proxy's KV
    /// routing and the engines; default: the repository's `.cache/tokenizers/qwen3`.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_TOKENIZER)]
    tokenizer: PathBuf,
    /// Disaggregated prefill/decode: the first half of the engines (at least one) prefill,
    /// the others decode, and every request runs its prefill leg on a prefill engine and its
    /// decode leg on a decode engine that pulls the KV (docs/disaggregation.md).
    #[arg(long)]
    disaggregated: bool,
}

/// Where `scripts/fetch-tokenizer.sh` puts the Qwen3 tokenizer.
const DEFAULT_TOKENIZER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../.cache/tokenizers/qwen3");

/// Checks that `dir` holds a tokenizer, with a hint on how to get one.
fn check_tokenizer(dir: &Path) -> anyhow::Result<()> {
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        if !dir.join(file).is_file() {
            bail!(
                "no {file} in {}: run scripts/fetch-tokenizer.sh from the repository root \
                 (or pass --tokenizer DIR)",
                dir.display()
            );
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();

    check_tokenizer(&cli.tokenizer)?;
    cli.tokenizer = std::fs::canonicalize(&cli.tokenizer).unwrap_or(cli.tokenizer);
    let sim = SimConfig {
        model: cli.model.clone(),
        speedup_ratio: cli.speedup_ratio,
        tokenizer: Some(cli.tokenizer.join("tokenizer.json")),
        // Benchmark tools read prompt-cache hits from here.
        prompt_tokens_details: true,
        kv_events: KvEventsConfig {
            endpoint: Some("tcp://127.0.0.1:0".to_string()),
            replay_endpoint: Some("tcp://127.0.0.1:0".to_string()),
            ..KvEventsConfig::default()
        },
        ..SimConfig::default()
    };
    let engines = spawn_engines(&cli, &sim).await?;

    let registry = Arc::new(InProcessRegistry::new());
    let bus = Arc::new(InProcessBus::new());
    let mut agents = Vec::with_capacity(engines.len());
    for (engine, role) in &engines {
        let agent = start_agent(&sim, engine, *role, &registry, &bus)
            .await
            .with_context(|| format!("starting the agent of engine {}", engine.local_addr()))?;
        agents.push(agent);
    }

    let yaml = demo_config(&cli);
    let config =
        Config::from_yaml_str(&yaml, "demo config").context("the demo config is invalid")?;
    let control = ControlPlane {
        registry: Some(registry as Arc<dyn Registry>),
        bus: Some(bus as Arc<dyn EventBus>),
    };
    let proxy = Proxy::bind_with(config, control)
        .await
        .context("binding the proxy's listeners")?;

    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "kvmesh demo: {} simulated engines, each with a worker-agent publishing its KV \
         events, behind kvmesh-proxy. Engines:\n",
        engines.len()
    )?;
    for ((engine, role), agent) in engines.iter().zip(&agents) {
        let role = match (role, agent.inbound_addr()) {
            (Role::Both, _) => String::new(),
            (role, Some(sidecar)) => {
                format!("  {} engine, sidecar http://{sidecar}", role.as_str())
            }
            (role, None) => format!("  {} engine", role.as_str()),
        };
        writeln!(
            out,
            "  http://{}  instance {}  (agent /metrics on http://{}){role}",
            engine.local_addr(),
            agent.instance_id(),
            agent.listen_addr()
        )?;
    }
    for (i, agent) in agents.iter().enumerate() {
        writeln!(out, "LISTENING agent-{i} {}", agent.listen_addr())?;
    }
    writeln!(out, "\nProxy config:\n")?;
    writeln!(out, "{yaml}")?;
    proxy.announce(&mut out)?;
    writeln!(out, "READY\n\nTry it:\n\n{}\n", curl(&cli))?;
    if let Some(grpc) = proxy.grpc_address() {
        writeln!(
            out,
            "Or over gRPC (KServe v2):\n\n{}\n",
            grpcurl(&cli, grpc)
        )?;
    }
    writeln!(
        out,
        "Why that engine (routing explained, nothing forwarded):\n\n{}\n",
        explain_curl(&cli, proxy.admin_address())
    )?;
    writeln!(
        out,
        "Metrics: curl -s http://{}/metrics | grep ^kvmesh_",
        proxy.admin_address()
    )?;
    writeln!(out, "Stop with Ctrl-C.")?;
    out.flush()?;
    drop(out);

    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    proxy
        .run(async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        })
        .await?;
    for agent in agents {
        agent.shutdown().await;
    }
    for (engine, _) in engines {
        engine.stop().await;
    }
    Ok(())
}

/// Starts the engines: `--engines` of them, the first half (at least one) prefill engines
/// and the rest decode engines with `--disaggregated`.
async fn spawn_engines(cli: &Cli, sim: &SimConfig) -> anyhow::Result<Vec<(EngineHandle, Role)>> {
    let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
    if !cli.disaggregated {
        let engines = kvmesh_engine_sim::spawn_engines(sim, localhost, 0, cli.engines)
            .await
            .context("starting the simulated engines")?;
        return Ok(engines.into_iter().map(|e| (e, Role::Both)).collect());
    }
    if cli.engines < 2 {
        bail!("--disaggregated needs at least 2 engines (one prefill, one decode)");
    }
    let prefill = cli.engines / 2;
    let mut engines = Vec::with_capacity(cli.engines);
    for (role, count) in [
        (Role::Prefill, prefill),
        (Role::Decode, cli.engines - prefill),
    ] {
        let config = SimConfig {
            kv_transfer: KvTransferConfig {
                role,
                ..KvTransferConfig::default()
            },
            ..sim.clone()
        };
        let started = kvmesh_engine_sim::spawn_engines(&config, localhost, 0, count)
            .await
            .with_context(|| format!("starting the {} engines", role.as_str()))?;
        engines.extend(started.into_iter().map(|e| (e, role)));
    }
    Ok(engines)
}

/// How long an agent advertises `draining` before deregistering when the demo stops (the
/// proxy has stopped already).
const AGENT_DRAIN: Duration = Duration::from_millis(100);

/// Starts the worker-agent of `engine` (registered with `role`): it subscribes to the engine's KV events and replay
/// sockets, registers the engine in `registry` and publishes on `bus`.
async fn start_agent(
    sim: &SimConfig,
    engine: &EngineHandle,
    role: Role,
    registry: &Arc<InProcessRegistry>,
    bus: &Arc<InProcessBus>,
) -> anyhow::Result<AgentHandle> {
    let events = engine
        .kv_events_addr()
        .context("the engine publishes no KV events")?;
    let mut config = AgentConfig::new(
        &format!("http://{}", engine.local_addr()),
        &sim.model,
        &format!("tcp://{events}"),
    );
    config.kv_events_replay_endpoint = engine.kv_replay_addr().map(|a| format!("tcp://{a}"));
    config.block_size = Some(sim.block_size);
    config.total_blocks = sim.num_gpu_blocks as u64;
    config.drain = AGENT_DRAIN;
    if role != Role::Both {
        // Disaggregated: the agent is the engine's inbound sidecar (registered in its
        // place), pacing the decode engines' KV transfers.
        config.inbound = Some(InboundConfig {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            kv_bytes_per_token: sim.kv_transfer.shape.bytes_per_token(),
            pacing: Some(PacerSettings::with_rate(sim.kv_transfer.link_gbps * 1e9)),
            measured_rate: false,
        });
    }
    config.role = match role {
        Role::Both => InstanceRole::Both,
        Role::Prefill => InstanceRole::Prefill,
        Role::Decode => InstanceRole::Decode,
    };
    let registry: Arc<dyn Registry> = Arc::clone(registry) as Arc<dyn Registry>;
    let bus: Arc<dyn EventBus> = Arc::clone(bus) as Arc<dyn EventBus>;
    Ok(kvmesh_agent::start(config, registry, bus).await?)
}

/// The proxy config of the demo, as YAML a user could save and edit (with etcd and NATS,
/// `discovery.kind: etcd` and `events.kind: nats` instead).
fn demo_config(cli: &Cli) -> String {
    let tokenizer = yaml_quote(&cli.tokenizer.display().to_string());
    let disaggregation = if cli.disaggregated {
        "    disaggregation:\n      mode: enforce\n"
    } else {
        ""
    };
    format!(
        "listeners:\n  - name: main\n    address: {}\nadmin:\n  address: {}\ngrpc:\n  address: {}\nmodels:\n  - name: {}\n    policy: kv\n    tokenizer: {tokenizer}\n    kv:\n      block_size: {}\n{disaggregation}    backends: []\ndiscovery:\n  kind: in_process\nevents:\n  kind: in_process\n",
        cli.listen,
        cli.admin,
        cli.grpc,
        cli.model,
        SimConfig::default().block_size
    )
}

/// `text` as a double-quoted YAML scalar.
fn yaml_quote(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A request a newcomer can paste: `-i` shows `x-kvmesh-instance` and `x-kvmesh-route`.
fn curl(cli: &Cli) -> String {
    format!(
        "curl -si http://{}/v1/chat/completions -H 'content-type: application/json' \\\n  -d '{}'",
        cli.listen,
        sample_body(cli)
    )
}

/// The same prompt as a KServe v2 `ModelInfer` (BYTES are base64 in grpcurl's JSON).
fn grpcurl(cli: &Cli, grpc: SocketAddr) -> String {
    format!(
        "grpcurl -plaintext -d '{{\"model_name\":\"{}\",\"inputs\":[{{\"name\":\"text_input\",\"datatype\":\"BYTES\",\"shape\":[1],\"contents\":{{\"bytes_contents\":[\"SGVsbG8sIGt2bWVzaCE=\"]}}}}],\"parameters\":{{\"max_tokens\":{{\"int64_param\":16}}}}}}' \\\n  {} inference.GRPCInferenceService/ModelInfer",
        cli.model, grpc
    )
}

/// The same request, explained by the admin listener.
fn explain_curl(cli: &Cli, admin: SocketAddr) -> String {
    format!(
        "curl -s http://{admin}/debug/route -H 'content-type: application/json' \\\n  -d '{}'",
        sample_body(cli)
    )
}

fn sample_body(cli: &Cli) -> String {
    format!(
        "{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello, kvmesh!\"}}],\"max_tokens\":16}}",
        cli.model
    )
}

//! Building blocks for the control-plane tests: real `etcd` and `nats-server` (through
//! `kvmesh_control::testing`), `kvmesh-engine-sim` publishing KV events, one `kvmesh-agent`
//! per engine, and `kvmesh-proxy` replicas with `discovery: etcd` and `events: nats`.

use std::time::Duration;

use anyhow::{Context, bail};
use kvmesh_control::testing::{EtcdServer, NatsServer};

use crate::cluster::MODEL;
use crate::{HttpClient, ScratchDir, Spawned};

/// Tokens per KV block of the engines and the proxy.
pub const BLOCK_SIZE: usize = 16;

/// etcd and NATS, with their data under a scratch directory.
pub struct Servers {
    /// etcd (`discovery`).
    pub etcd: EtcdServer,
    /// nats-server (`events`).
    pub nats: NatsServer,
}

impl Servers {
    /// Starts both on free loopback ports, waiting until they answer.
    pub async fn start(scratch: &ScratchDir) -> anyhow::Result<Self> {
        let etcd = EtcdServer::start(&scratch.path().join("etcd"))
            .await
            .context("starting etcd (Debian package etcd-server)")?;
        let nats = NatsServer::start(&scratch.path().join("nats"))
            .await
            .context("starting nats-server (Debian package nats-server)")?;
        Ok(Self { etcd, nats })
    }
}

/// One simulated engine and where it publishes its KV events.
#[derive(Debug, Clone)]
pub struct Engine {
    /// `http://ip:port` of its OpenAI API.
    pub url: String,
    /// `tcp://ip:port` of its ZMQ PUB socket.
    pub events: String,
    /// `tcp://ip:port` of its ZMQ replay socket.
    pub replay: String,
}

/// Starts one `kvmesh-engine-sim` process with `engines` engines that publish KV events.
pub fn start_event_engines(
    scratch: &ScratchDir,
    engines: usize,
) -> anyhow::Result<(Spawned, Vec<Engine>)> {
    start_event_engines_with(scratch, engines, &[])
}

/// [`start_event_engines`] with `extra` simulator flags.
pub fn start_event_engines_with(
    scratch: &ScratchDir,
    engines: usize,
    extra: &[&str],
) -> anyhow::Result<(Spawned, Vec<Engine>)> {
    spawn_event_engines(scratch, engines, &[&["--no-delay"], extra].concat())
}

/// [`start_event_engines`] with the simulator's timing model in real time (a stream takes
/// about 6 ms per token), for tests that act while streams run.
pub fn start_timed_event_engines(
    scratch: &ScratchDir,
    engines: usize,
) -> anyhow::Result<(Spawned, Vec<Engine>)> {
    spawn_event_engines(scratch, engines, &[])
}

/// [`start_event_engines`] with engines of `block_size`-token KV blocks instead of
/// [`BLOCK_SIZE`].
pub fn start_event_engines_of_block_size(
    scratch: &ScratchDir,
    engines: usize,
    block_size: usize,
) -> anyhow::Result<(Spawned, Vec<Engine>)> {
    spawn_event_engines_of(scratch, engines, block_size, &["--no-delay"])
}

fn spawn_event_engines(
    scratch: &ScratchDir,
    engines: usize,
    extra: &[&str],
) -> anyhow::Result<(Spawned, Vec<Engine>)> {
    spawn_event_engines_of(scratch, engines, BLOCK_SIZE, extra)
}

fn spawn_event_engines_of(
    scratch: &ScratchDir,
    engines: usize,
    block_size: usize,
    extra: &[&str],
) -> anyhow::Result<(Spawned, Vec<Engine>)> {
    let block_size = block_size.to_string();
    let mut args = vec![
        "--block-size",
        &block_size,
        "--kv-events-endpoint",
        "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let sim = crate::cluster::start_engines(scratch, engines, &args)?;
    let listener = |name: String| -> anyhow::Result<std::net::SocketAddr> {
        sim.listeners()
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, addr)| *addr)
            .with_context(|| format!("the simulator announced no {name}"))
    };
    let mut found = Vec::with_capacity(engines);
    for i in 0..engines {
        found.push(Engine {
            url: format!("http://{}", listener(format!("engine-{i}"))?),
            events: format!("tcp://{}", listener(format!("kv-events-{i}"))?),
            replay: format!("tcp://{}", listener(format!("kv-replay-{i}"))?),
        });
    }
    Ok((sim, found))
}

/// Starts `kvmesh-agent` beside `engine`, with lease TTL `lease_ttl` and drain `drain`.
pub fn start_agent(
    scratch: &ScratchDir,
    servers: &Servers,
    engine: &Engine,
    lease_ttl: Duration,
    drain: Duration,
) -> anyhow::Result<Spawned> {
    let mut args = agent_args(servers, engine, lease_ttl, drain);
    args.extend(["--block-size".to_string(), BLOCK_SIZE.to_string()]);
    Spawned::start("kvmesh-agent", &args, scratch.path())
}

/// The flags of a `kvmesh-agent` beside `engine` (no `--block-size`: the engine's).
pub fn agent_args(
    servers: &Servers,
    engine: &Engine,
    lease_ttl: Duration,
    drain: Duration,
) -> Vec<String> {
    agent_args_for(
        &servers.etcd.url(),
        &servers.nats.url(),
        engine,
        lease_ttl,
        drain,
    )
}

/// [`agent_args`] for the etcd members at `etcd` (comma-separated) and NATS at `nats`.
pub fn agent_args_for(
    etcd: &str,
    nats: &str,
    engine: &Engine,
    lease_ttl: Duration,
    drain: Duration,
) -> Vec<String> {
    [
        "--engine-url",
        &engine.url,
        "--model",
        MODEL,
        "--kv-events-endpoint",
        &engine.events,
        "--kv-events-replay-endpoint",
        &engine.replay,
        "--etcd",
        etcd,
        "--nats",
        nats,
        "--lease-ttl",
        &format!("{}ms", lease_ttl.as_millis()),
        "--drain",
        &format!("{}ms", drain.as_millis()),
        "--load-interval",
        "100ms",
        "--health-interval",
        "200ms",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A proxy config serving [`MODEL`] with `policy: kv` from etcd's instances and NATS's
/// events; `extra` YAML is appended.
pub fn control_proxy_config(servers: &Servers, extra: &str) -> String {
    control_proxy_config_for(&servers.etcd.url(), &servers.nats.url(), extra)
}

/// [`control_proxy_config`] for the etcd members at `etcd` (comma-separated) and NATS at
/// `nats`.
pub fn control_proxy_config_for(etcd: &str, nats: &str, extra: &str) -> String {
    format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         health_check:\n  enabled: false\n\
         models:\n  - name: {MODEL}\n    policy: kv\n    kv:\n      block_size: {BLOCK_SIZE}\n    backends: []\n\
         discovery:\n  kind: etcd\n  endpoint: {etcd}\n  initial_sync_timeout: 5s\n\
         events:\n  kind: nats\n  url: {nats}\n  resync_timeout: 1s\n{extra}"
    )
}

/// The sum of every sample of metric `name` on `proxy`'s admin `/metrics` ([`metric_total`]).
pub async fn proxy_metric_total(
    client: &HttpClient,
    proxy: &Spawned,
    name: &str,
) -> anyhow::Result<f64> {
    let metrics = client
        .get(&format!("{}/metrics", proxy.url("admin")))
        .await?;
    Ok(metric_total(&String::from_utf8_lossy(&metrics.body), name))
}

/// Asserts that `proxy` migrated exactly `streams` streams (`kvmesh_migrations_total`), one
/// for each stream its killed engine carried.
pub async fn assert_migrations(client: &HttpClient, proxy: &Spawned, streams: usize) {
    let migrations = proxy_metric_total(client, proxy, "kvmesh_migrations_total")
        .await
        .expect("the proxy's metrics");
    assert_eq!(
        migrations, streams as f64,
        "each stream on the killed engine moved once"
    );
}

/// The value of the first sample of `metrics` (Prometheus text) whose line starts with
/// `series` (name and labels, e.g. `kvmesh_events_connected` or `x{a="b"}`).
pub fn metric(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let rest = line.strip_prefix(series)?;
            let value = rest.strip_prefix(' ')?;
            value.trim().parse().ok()
        })
}

/// The sum of every sample of metric `name` (any labels) in `metrics` (Prometheus text).
pub fn metric_total(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            let value = match rest.as_bytes().first() {
                Some(b'{') => rest.rsplit_once(' ')?.1,
                Some(b' ') => rest.trim(),
                _ => return None,
            };
            value.parse::<f64>().ok()
        })
        .sum()
}

/// Polls `GET url` (Prometheus text) until `series` satisfies `check`, up to `timeout`;
/// returns the value.
pub async fn await_metric(
    client: &HttpClient,
    url: &str,
    series: &str,
    check: impl Fn(f64) -> bool,
    timeout: Duration,
) -> anyhow::Result<f64> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let text = client
            .get(url)
            .await
            .map(|r| String::from_utf8_lossy(&r.body).into_owned());
        if let Ok(text) = &text
            && let Some(value) = metric(text, series)
            && check(value)
        {
            return Ok(value);
        }
        if tokio::time::Instant::now() >= deadline {
            let seen = text
                .ok()
                .map(|t| {
                    t.lines()
                        .filter(|l| l.starts_with(series.split('{').next().unwrap_or(series)))
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default();
            bail!(
                "{series} at {url} never passed its check within {timeout:?}; last seen:\n{seen}"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A completions request for [`MODEL`] with token ids `prompt`.
pub fn token_prompt(prompt: &[u32], max_tokens: u32) -> serde_json::Value {
    model_prompt(MODEL, prompt, max_tokens)
}

/// A completions request for `model` (a model or a LoRA adapter) with token ids `prompt`.
pub fn model_prompt(model: &str, prompt: &[u32], max_tokens: u32) -> serde_json::Value {
    serde_json::json!({"model": model, "prompt": prompt, "max_tokens": max_tokens})
}

/// `blocks` full blocks of token ids unique to `seed`.
pub fn prompt_tokens(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK_SIZE) as u32)
        .map(|i| 1000 + seed * 7919 + i * 31)
        .collect()
}

/// How long [`await_explained`] polls.
const EXPLAIN_DEADLINE: Duration = Duration::from_secs(15);

/// Polls proxy `proxy`'s `/debug/route` for the completion `request` (in `session` if any)
/// until `done` holds for the explanation, or the deadline passes.
pub async fn await_explained(
    client: &HttpClient,
    proxy: &Spawned,
    request: &serde_json::Value,
    session: Option<&str>,
    done: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let url = format!("{}/debug/route?route=completions", proxy.url("admin"));
    let mut headers = vec![("content-type", "application/json")];
    headers.extend(session.map(|session| ("x-session-id", session)));
    let body = request.to_string();
    let deadline = std::time::Instant::now() + EXPLAIN_DEADLINE;
    loop {
        let response = client
            .call(http::Method::POST, &url, &headers, body.clone())
            .await?;
        anyhow::ensure!(response.status == 200, "debug/route: {}", response.status);
        let explained: serde_json::Value = serde_json::from_slice(&response.body)?;
        if done(&explained) {
            return Ok(explained);
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "never reached: {explained}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

//! `kvmesh-demo`: the whole kvmesh request path on one machine, nothing to install.
//!
//! Starts simulated engines in-process (`kvmesh-engine-sim` as a library) and
//! the proxy in front of them, with a config built here and printed, then
//! prints a ready-to-paste `curl` and serves until Ctrl-C or SIGTERM. This
//! launcher is the only place where the proxy meets the simulator, so a
//! production `kvmesh-proxy` build carries no simulator code.
//!
//! The proxy routes with `policy: kv` and the real Qwen3 tokenizer, which the
//! simulated engines use too, so every response carries `x-kvmesh-route` and
//! a conversation's turns land where its prefix is cached.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Parser;
use kvmesh_config::Config;
use kvmesh_engine_sim::SimConfig;
use kvmesh_proxy::Proxy;
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
        ..SimConfig::default()
    };
    let engines =
        kvmesh_engine_sim::spawn_engines(&sim, IpAddr::V4(Ipv4Addr::LOCALHOST), 0, cli.engines)
            .await
            .context("starting the simulated engines")?;
    let backends: Vec<String> = engines
        .iter()
        .map(|e| format!("http://{}", e.local_addr()))
        .collect();

    let yaml = demo_config(&cli, &backends);
    let config =
        Config::from_yaml_str(&yaml, "demo config").context("the demo config is invalid")?;
    let proxy = Proxy::bind(config)
        .await
        .context("binding the proxy's listeners")?;

    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "kvmesh demo: {} simulated engines behind kvmesh-proxy. Config:\n",
        backends.len()
    )?;
    writeln!(out, "{yaml}")?;
    proxy.announce(&mut out)?;
    writeln!(out, "READY\n\nTry it:\n\n{}\n", curl(&cli))?;
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
    for engine in engines {
        engine.stop().await;
    }
    Ok(())
}

/// The proxy config of the demo, as YAML a user could save and edit.
fn demo_config(cli: &Cli, backends: &[String]) -> String {
    let tokenizer = yaml_quote(&cli.tokenizer.display().to_string());
    let mut yaml = format!(
        "listeners:\n  - name: main\n    address: {}\nadmin:\n  address: {}\nmodels:\n  - name: {}\n    policy: kv\n    tokenizer: {tokenizer}\n    kv:\n      block_size: {}\n    backends:\n",
        cli.listen,
        cli.admin,
        cli.model,
        SimConfig::default().block_size
    );
    for url in backends {
        yaml.push_str(&format!("      - url: {url}\n"));
    }
    yaml
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

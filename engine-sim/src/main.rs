//! `kvmesh-engine-sim`: runs N simulated engines on consecutive ports (and their KV event
//! sockets, when configured).

use std::io::Write;

use anyhow::Context;
use clap::Parser;
use kvmesh_engine_sim::cli::Cli;
use kvmesh_engine_sim::spawn_engines;
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let cli = Cli::parse();
    let engines = spawn_engines(&cli.config(), cli.host, cli.port, cli.engines)
        .await
        .context("starting engines")?;
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    {
        let mut out = std::io::stdout().lock();
        for (i, engine) in engines.iter().enumerate() {
            writeln!(out, "LISTENING engine-{i} {}", engine.local_addr())?;
            if let Some(addr) = engine.kv_events_addr() {
                writeln!(out, "LISTENING kv-events-{i} {addr}")?;
            }
            if let Some(addr) = engine.kv_replay_addr() {
                writeln!(out, "LISTENING kv-replay-{i} {addr}")?;
            }
        }
        writeln!(out, "READY")?;
        out.flush()?;
    }
    tokio::select! {
        _ = terminate.recv() => {}
        r = tokio::signal::ctrl_c() => r.context("waiting for SIGINT")?,
    }
    for engine in engines {
        engine.stop().await;
    }
    Ok(())
}

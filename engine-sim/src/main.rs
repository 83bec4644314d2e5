//! `kvmesh-engine-sim`: runs N simulated engines on consecutive ports (and their KV event
//! sockets, when configured, one pair per data-parallel rank; an SGLang prefill engine's
//! bootstrap server).

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
            if let Some(addr) = engine.bootstrap_addr() {
                writeln!(out, "LISTENING bootstrap-{i} {addr}")?;
            }
            // Rank 0's sockets keep the engine's name; rank r > 0 adds `-dp<r>`.
            for rank in 0..engine.dp_ranks() {
                let suffix = match rank {
                    0 => String::new(),
                    r => format!("-dp{r}"),
                };
                if let Some(addr) = engine.rank_kv_events_addr(rank) {
                    writeln!(out, "LISTENING kv-events-{i}{suffix} {addr}")?;
                }
                if let Some(addr) = engine.rank_kv_replay_addr(rank) {
                    writeln!(out, "LISTENING kv-replay-{i}{suffix} {addr}")?;
                }
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

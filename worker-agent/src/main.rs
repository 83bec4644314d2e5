//! `kvmesh-agent`: the worker-agent binary. Prints `LISTENING agent <addr>` (and `LISTENING
//! inbound <addr>` with `--inbound-listen`) and `READY` once it is subscribed to the engine
//! and registered; SIGTERM or SIGINT drains, then deregisters.

use std::io::Write;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use kvmesh_agent::cli::Cli;
use kvmesh_control::{EtcdRegistry, NatsBus};
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let config = cli.config();
    let registry =
        Arc::new(EtcdRegistry::with_settings(&cli.etcd_settings()).context("etcd settings")?);
    let name = format!("kvmesh-agent-{}", config.instance_id);
    let bus = Arc::new(
        NatsBus::connect_with(&cli.nats_settings(&name))
            .await
            .with_context(|| format!("connecting to NATS at {}", cli.nats))?,
    );
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let agent = kvmesh_agent::start(config, registry, bus)
        .await
        .context("starting the agent")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "LISTENING agent {}", agent.listen_addr())?;
        if let Some(inbound) = agent.inbound_addr() {
            writeln!(out, "LISTENING inbound {inbound}")?;
        }
        writeln!(out, "READY")?;
        out.flush()?;
    }
    tracing::info!(instance_id = %agent.instance_id(), "agent ready");
    tokio::select! {
        _ = terminate.recv() => {}
        r = tokio::signal::ctrl_c() => r.context("waiting for SIGINT")?,
    }
    tracing::info!("shutting down: draining");
    agent.shutdown().await;
    Ok(())
}

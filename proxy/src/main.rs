//! `kvmesh-proxy`: run the proxy from a config file, or check one.
//!
//! ```text
//! kvmesh-proxy --config FILE         serve; prints LISTENING <name> <addr>… then READY
//! kvmesh-proxy --check-config FILE   print "ok" (exit 0) or the error (stderr, exit 1)
//! ```

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kvmesh_config::Config;
use kvmesh_proxy::Proxy;
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

/// How long leftover background work may delay the exit after the drain.
const RUNTIME_SHUTDOWN: Duration = Duration::from_millis(100);

/// The kvmesh edge proxy.
#[derive(Debug, Parser)]
#[command(name = "kvmesh-proxy", version, about)]
struct Cli {
    /// Serve with this config file.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "check_config",
        conflicts_with = "check_config"
    )]
    config: Option<PathBuf>,
    /// Validate this config file: print "ok" and exit 0, or print the error and exit 1.
    #[arg(long, value_name = "FILE")]
    check_config: Option<PathBuf>,
}

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    if let Some(path) = cli.check_config {
        return Ok(match Config::load(&path) {
            Ok(_) => {
                println!("ok");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("{error}");
                ExitCode::FAILURE
            }
        });
    }
    let Some(path) = cli.config else {
        anyhow::bail!("--config FILE or --check-config FILE is required");
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let config = match Config::load(&path) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("{error}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let served = runtime.block_on(serve(config));
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
    served?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let mut terminate =
        signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let proxy = Proxy::bind(config).await?;
    let mut stdout = std::io::stdout().lock();
    proxy.announce(&mut stdout)?;
    writeln!(stdout, "READY")?;
    stdout.flush()?;
    drop(stdout);
    proxy
        .run(async move {
            tokio::select! {
                _ = terminate.recv() => tracing::info!("SIGTERM received"),
                _ = interrupt.recv() => tracing::info!("SIGINT received"),
            }
        })
        .await?;
    Ok(())
}

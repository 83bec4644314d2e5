//! `kvmesh-proxy`: run the proxy from a config file, or check one.
//!
//! ```text
//! kvmesh-proxy --config FILE         serve; prints LISTENING <name> <addr>… then READY;
//!                                    SIGHUP reloads FILE
//! kvmesh-proxy --check-config FILE   print "ok" (exit 0) or the error (stderr, exit 1)
//! kvmesh-proxy hash-key              print the SHA-256 of the API key read from stdin
//! ```

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvmesh_config::Config;
use kvmesh_proxy::{Proxy, check_config_files, sha256_hex};
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

/// How long leftover background work may delay the exit after the drain.
const RUNTIME_SHUTDOWN: Duration = Duration::from_millis(100);

/// The kvmesh edge proxy.
#[derive(Debug, Parser)]
#[command(name = "kvmesh-proxy", version, about, subcommand_negates_reqs = true)]
struct Cli {
    /// A tool instead of serving.
    #[command(subcommand)]
    command: Option<Command>,
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

/// Tools.
#[derive(Debug, Subcommand)]
enum Command {
    /// Print the SHA-256 (hex) of the API key read from stdin, for `auth.keys[].sha256`
    /// (one trailing newline is ignored): `printf %s "$KEY" | kvmesh-proxy hash-key`.
    HashKey,
}

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    if let Some(Command::HashKey) = cli.command {
        return hash_key();
    }
    if let Some(path) = cli.check_config {
        let checked = Config::load(&path)
            .map_err(|error| error.to_string())
            .and_then(|config| check_config_files(&config).map_err(|error| error.to_string()));
        return Ok(match checked {
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
    // On one CPU (pinned, or a cgroup quota of one) a single-threaded runtime serves
    // everything without the work-stealing scheduler's hand-offs between threads: ≈ 5 % less
    // CPU per request on the overhead benchmark.
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let mut builder = if cpus == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let runtime = builder
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let flavor = if cpus == 1 {
        "current_thread"
    } else {
        "multi_thread"
    };
    tracing::info!(cpus, flavor, "runtime started");
    let served = runtime.block_on(serve(config, path));
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
    served?;
    Ok(ExitCode::SUCCESS)
}

/// Prints the SHA-256 of the key on stdin.
fn hash_key() -> anyhow::Result<ExitCode> {
    let mut key = Vec::new();
    std::io::stdin()
        .read_to_end(&mut key)
        .context("reading the key from stdin")?;
    let key = key
        .strip_suffix(b"\n")
        .map(|key| key.strip_suffix(b"\r").unwrap_or(key))
        .unwrap_or(&key);
    if key.is_empty() {
        eprintln!("no key on stdin");
        return Ok(ExitCode::FAILURE);
    }
    println!("{}", sha256_hex(key));
    Ok(ExitCode::SUCCESS)
}

async fn serve(config: Config, path: PathBuf) -> anyhow::Result<()> {
    let mut terminate =
        signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut hangup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
    let proxy = Proxy::bind_file(config, path).await?;
    let reload = proxy.reload_handle();
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            tracing::info!("SIGHUP received: reloading the config");
            // The reloader logs and counts the outcome.
            let _ = reload.reload().await;
        }
    });
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

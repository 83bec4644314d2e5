//! `kvmesh-engine-cache`: the engines' prefix-cache counters around a command, for load
//! generators that are not `kvmesh-bench` (NVIDIA AIPerf in `benches/routing-quality.sh`).
//! Reads every engine's `/metrics` (vLLM names), runs the command, reads them again and writes
//! the differences as the `cache` object of a `kvmesh-bench` report (hit rate, requests per
//! engine, preemptions; no oracle, which needs the prompts).
//!
//! ```text
//! kvmesh-engine-cache --engine-metrics http://127.0.0.1:8001,http://127.0.0.1:8002 \
//!   --json cache.json -- aiperf profile ...
//! ```
//!
//! Exits with the command's status; the counters are written only when it succeeded.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Parser;
use kvmesh_bench::cache_report::CacheReport;
use kvmesh_bench::engine_metrics::{EngineDelta, EngineProbe, scrape_all};

/// Engine prefix-cache counters around a command.
#[derive(Debug, Parser)]
#[command(name = "kvmesh-engine-cache", version, about)]
struct Args {
    /// Base URLs of the engines whose `/metrics` are read (comma-separated or repeated).
    #[arg(long, value_delimiter = ',', required = true)]
    engine_metrics: Vec<String>,
    /// Where the counters go (JSON, a `kvmesh-bench` report's `cache` object).
    #[arg(long)]
    json: PathBuf,
    /// The command to run, and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<ExitCode> {
    let args = Args::parse();
    let mut probes = Vec::with_capacity(args.engine_metrics.len());
    for url in &args.engine_metrics {
        probes.push(EngineProbe::new(url).await?);
    }
    let before = scrape_all(&probes).await?;
    let (program, rest) = args.command.split_first().context("no command given")?;
    let status = tokio::process::Command::new(program)
        .args(rest)
        .status()
        .await
        .with_context(|| format!("cannot run {program}"))?;
    if !status.success() {
        eprintln!("kvmesh-engine-cache: {program} failed: {status}");
        return Ok(ExitCode::from(
            status
                .code()
                .and_then(|c| u8::try_from(c).ok())
                .unwrap_or(1),
        ));
    }
    let after = scrape_all(&probes).await?;
    let engines: Vec<EngineDelta> = probes
        .iter()
        .zip(before.iter().zip(&after))
        .map(|(probe, (b, a))| EngineDelta::between(probe.url(), b, a))
        .collect();
    if engines.iter().all(|e| e.requests == 0) {
        bail!("the engines finished no request while {program} ran");
    }
    let report = CacheReport::new(engines, None);
    std::fs::write(&args.json, serde_json::to_vec_pretty(&report)?)
        .with_context(|| format!("cannot write {}", args.json.display()))?;
    Ok(ExitCode::SUCCESS)
}

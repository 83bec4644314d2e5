//! `kvmesh-bench`: load an OpenAI-compatible endpoint and report throughput and latency.

use anyhow::Context;
use clap::Parser;

use kvmesh_bench::cli::Args;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(threads) = args.threads {
        runtime.worker_threads(usize::try_from(threads).context("thread count")?);
    }
    let runtime = runtime.build().context("cannot start the async runtime")?;
    let report = runtime.block_on(kvmesh_bench::run::run(&args))?;
    print!("{report}");
    if let Some(path) = &args.json {
        let json = serde_json::to_vec_pretty(&report).context("cannot serialise the report")?;
        std::fs::write(path, json).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

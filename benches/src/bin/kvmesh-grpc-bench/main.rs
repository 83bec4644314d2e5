//! `kvmesh-grpc-bench`: the same completions through one kvmesh-proxy over its OpenAI HTTP
//! listener and over its KServe v2 gRPC listener, unary and streaming, closed loop; prints
//! a Markdown table (throughput, end-to-end latency, time to first token). With `--epp`, the
//! `epp` lane runs the proxy's endpoint picker exchange as Envoy does (its "TTFT" is the
//! pick's latency, its E2E the whole exchange).
//!
//! ```text
//! kvmesh-grpc-bench --http 127.0.0.1:8080 --grpc 127.0.0.1:8787 --model sim-model \
//!   --concurrency 32 --duration 10 --warmup 2 --max-tokens 16
//! ```
//!
//! Lanes, one after the other: HTTP/1.1 (a keep-alive connection per worker), HTTP/2 (h2c,
//! one connection) and gRPC (one HTTP/2 connection), each unary then streaming. A gRPC
//! streaming worker keeps one `ModelStreamInfer` call open and sends its next request when
//! the previous one's last response arrived.

mod epp;
mod grpc;
mod http;
mod load;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};

use crate::load::{LaneReport, Protocol, Shape, run_lane};

/// Compares the gRPC and HTTP paths of one kvmesh-proxy.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvmesh-grpc-bench", version, about)]
pub(crate) struct Args {
    /// The proxy's OpenAI HTTP listener.
    #[arg(long)]
    pub(crate) http: SocketAddr,
    /// The proxy's gRPC listener.
    #[arg(long)]
    pub(crate) grpc: SocketAddr,
    /// The proxy's endpoint picker listener (the `epp` lane).
    #[arg(long)]
    pub(crate) epp: Option<SocketAddr>,
    /// The model to request.
    #[arg(long, default_value = "sim-model")]
    pub(crate) model: String,
    /// Concurrent workers per lane.
    #[arg(long, default_value_t = 32)]
    pub(crate) concurrency: usize,
    /// Seconds measured per lane.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) duration: f64,
    /// Seconds of load before measuring, per lane.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) warmup: f64,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16)]
    pub(crate) max_tokens: u32,
    /// Words in the prompt.
    #[arg(long, default_value_t = 16)]
    pub(crate) prompt_words: usize,
    /// Runtime threads (default: the CPUs the process may use).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Lanes to run, in order (default: every lane but `epp`).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) lanes: Vec<Lane>,
}

/// One protocol and request shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Lane {
    /// OpenAI over HTTP/1.1, one answer per request.
    Http1Unary,
    /// OpenAI over h2c, one answer per request.
    H2cUnary,
    /// KServe `ModelInfer`.
    GrpcUnary,
    /// OpenAI over HTTP/1.1, streamed (SSE).
    Http1Stream,
    /// OpenAI over h2c, streamed (SSE).
    H2cStream,
    /// KServe `ModelStreamInfer`.
    GrpcStream,
    /// The endpoint picker: one ext_proc exchange per request (the same completion), not
    /// forwarded.
    Epp,
}

impl Lane {
    const ALL: [Lane; 6] = [
        Lane::Http1Unary,
        Lane::H2cUnary,
        Lane::GrpcUnary,
        Lane::Http1Stream,
        Lane::H2cStream,
        Lane::GrpcStream,
    ];

    fn parts(self) -> (Protocol, Shape) {
        match self {
            Self::Http1Unary => (Protocol::Http1, Shape::Unary),
            Self::H2cUnary => (Protocol::H2c, Shape::Unary),
            Self::GrpcUnary => (Protocol::Grpc, Shape::Unary),
            Self::Http1Stream => (Protocol::Http1, Shape::Stream),
            Self::H2cStream => (Protocol::H2c, Shape::Stream),
            Self::GrpcStream => (Protocol::Grpc, Shape::Stream),
            Self::Epp => (Protocol::Epp, Shape::Unary),
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(threads) = args.threads {
        runtime.worker_threads(threads);
    }
    let runtime = runtime.build().context("cannot start the async runtime")?;
    let reports = runtime.block_on(run(&args))?;
    println!(
        "| lane | requests/s | output tok/s | E2E p50 ms | E2E p99 ms | TTFT p50 ms | TTFT p99 ms | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for report in reports {
        println!("{report}");
    }
    Ok(())
}

async fn run(args: &Args) -> anyhow::Result<Vec<LaneReport>> {
    let prompt = prompt(args.prompt_words);
    let lanes = if args.lanes.is_empty() {
        &Lane::ALL[..]
    } else {
        &args.lanes[..]
    };
    let mut reports = Vec::new();
    for lane in lanes {
        let (protocol, shape) = lane.parts();
        let report = run_lane(args, protocol, shape, &prompt)
            .await
            .with_context(|| format!("lane {} {}", protocol.label(), shape.label()))?;
        eprintln!("{report}");
        reports.push(report);
    }
    Ok(reports)
}

/// A prompt of `words` words.
fn prompt(words: usize) -> String {
    const WORDS: [&str; 8] = [
        "the", "cache", "routes", "tokens", "to", "a", "warm", "engine",
    ];
    (0..words)
        .map(|i| WORDS[i % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// `seconds` as a duration (negative or invalid: zero).
pub(crate) fn seconds(seconds: f64) -> Duration {
    Duration::try_from_secs_f64(seconds).unwrap_or_default()
}

//! The closed loop of one lane: `concurrency` workers send back to back for the warmup and
//! the measured duration; only requests that start and end inside the measured window count.

use std::fmt;
use std::time::Duration;

use kvmesh_bench::histogram::LatencyHistogram;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::{Args, epp, grpc, http, seconds};

/// The transport of a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// OpenAI HTTP/1.1, a keep-alive connection per worker.
    Http1,
    /// OpenAI HTTP/2 (h2c), one connection shared by the workers.
    H2c,
    /// KServe v2 gRPC, one HTTP/2 connection shared by the workers.
    Grpc,
    /// The endpoint picker's ext_proc exchanges, one HTTP/2 connection shared by the workers.
    Epp,
}

impl Protocol {
    /// The lane's name.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Http1 => "http/1.1",
            Self::H2c => "http/2",
            Self::Grpc => "grpc",
            Self::Epp => "epp",
        }
    }
}

/// Unary or streaming requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// One answer per request.
    Unary,
    /// The answer streamed chunk by chunk.
    Stream,
}

impl Shape {
    /// The lane's name.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Unary => "unary",
            Self::Stream => "stream",
        }
    }
}

/// One finished request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    /// When it was sent.
    pub(crate) started: Instant,
    /// Until its first response (streaming: its first chunk).
    pub(crate) first: Duration,
    /// Until its last byte.
    pub(crate) total: Duration,
}

/// What one worker measured.
#[derive(Debug, Default)]
struct Tally {
    e2e: LatencyHistogram,
    ttft: LatencyHistogram,
    errors: u64,
}

/// The numbers of one lane.
#[derive(Debug)]
pub(crate) struct LaneReport {
    name: String,
    requests_per_sec: f64,
    tokens_per_sec: f64,
    e2e: LatencyHistogram,
    ttft: LatencyHistogram,
    errors: u64,
}

impl fmt::Display for LaneReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |h: &LatencyHistogram| {
            h.summary().map_or(("-".to_string(), "-".to_string()), |p| {
                (format!("{:.2}", p.p50), format!("{:.2}", p.p99))
            })
        };
        let (e2e50, e2e99) = ms(&self.e2e);
        let (ttft50, ttft99) = ms(&self.ttft);
        write!(
            f,
            "| {} | {:.0} | {:.0} | {e2e50} | {e2e99} | {ttft50} | {ttft99} | {} |",
            self.name, self.requests_per_sec, self.tokens_per_sec, self.errors
        )
    }
}

/// A worker's connection and request.
pub(crate) enum Worker {
    /// OpenAI HTTP.
    Http(http::HttpWorker),
    /// KServe gRPC.
    Grpc(Box<grpc::GrpcWorker>),
    /// The endpoint picker.
    Epp(epp::EppWorker),
}

impl Worker {
    async fn send(&mut self) -> anyhow::Result<Sample> {
        match self {
            Self::Http(worker) => worker.send().await,
            Self::Grpc(worker) => worker.send().await,
            Self::Epp(worker) => worker.send().await,
        }
    }
}

/// Runs one lane and reports it.
pub(crate) async fn run_lane(
    args: &Args,
    protocol: Protocol,
    shape: Shape,
    prompt: &str,
) -> anyhow::Result<LaneReport> {
    let workers = match protocol {
        Protocol::Http1 | Protocol::H2c => {
            http::workers(args, protocol == Protocol::H2c, shape, prompt).await?
        }
        Protocol::Grpc => grpc::workers(args, shape, prompt).await?,
        Protocol::Epp => epp::workers(args, prompt).await?,
    };
    let measure_from = Instant::now() + seconds(args.warmup);
    let measure_until = measure_from + seconds(args.duration);
    let mut tasks = JoinSet::new();
    for mut worker in workers {
        tasks.spawn(async move {
            let mut tally = Tally::default();
            while Instant::now() < measure_until {
                match worker.send().await {
                    Ok(sample) => {
                        let ended = sample.started + sample.total;
                        if sample.started >= measure_from && ended <= measure_until {
                            tally.e2e.record(sample.total);
                            if shape == Shape::Stream || protocol == Protocol::Epp {
                                tally.ttft.record(sample.first);
                            }
                        }
                    }
                    Err(error) => {
                        tally.errors += 1;
                        if tally.errors == 1 {
                            eprintln!("request failed: {error:#}");
                        }
                    }
                }
            }
            tally
        });
    }
    let mut total = Tally::default();
    while let Some(tally) = tasks.join_next().await {
        let tally = tally?;
        total.e2e.merge(&tally.e2e);
        total.ttft.merge(&tally.ttft);
        total.errors += tally.errors;
    }
    let requests_per_sec = total.e2e.count() as f64 / args.duration.max(f64::MIN_POSITIVE);
    Ok(LaneReport {
        name: format!("{} {}", protocol.label(), shape.label()),
        requests_per_sec,
        tokens_per_sec: requests_per_sec * f64::from(args.max_tokens),
        e2e: total.e2e,
        ttft: total.ttft,
        errors: total.errors,
    })
}

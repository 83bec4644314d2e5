//! One benchmark run from command-line arguments to report.

use std::sync::Arc;
use std::time::Instant;

use http::HeaderValue;

use crate::cli::Args;
use crate::client::Client;
use crate::closed_loop::run_closed_loop;
use crate::connection::Connector;
use crate::open_loop::{OpenLoop, run_open_loop};
use crate::plan::{DriverError, Plan, Stop};
use crate::process_cpu::process_cpu_time;
use crate::report::{LoadShape, Report, RunInfo};
use crate::target::{Target, TargetError};
use crate::workload::{SyntheticSpec, SyntheticWorkload, Workload, WorkloadError};

/// Why a run could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The target URL is unusable.
    #[error(transparent)]
    Target(#[from] TargetError),
    /// The workload could not be built.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// The API key is not a valid header value.
    #[error("the API key contains characters not allowed in a header")]
    ApiKey,
    /// A load task failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

/// Runs the benchmark `args` describe and returns its report.
pub async fn run(args: &Args) -> Result<Report, RunError> {
    let started = Instant::now();
    let cpu_at_start = process_cpu_time();
    let target = Target::resolve(&args.url).await?;
    let spec = SyntheticSpec {
        endpoint: args.endpoint,
        model: args.model.clone(),
        prompt_words: args.prompt_tokens,
        max_tokens: args.max_tokens,
        stream: args.stream,
        seed: args.seed,
    };
    let workload: Arc<dyn Workload> = Arc::new(SyntheticWorkload::new(&spec, &target, args.http2)?);
    let authorization = args
        .api_key
        .as_ref()
        .map(|key| HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| RunError::ApiKey))
        .transpose()?;
    let client = Arc::new(Client::new(
        Connector::new(target.addr, args.http2),
        args.timeout,
        target.host_header(),
        authorization,
    ));
    let plan = Plan {
        warmup: args.warmup,
        stop: args
            .requests
            .map_or(Stop::After(args.duration), Stop::Requests),
    };
    let (outcome, load) = match args.rate {
        Some(rate) => {
            let shape = OpenLoop {
                rate,
                max_outstanding: usize::try_from(args.max_outstanding).unwrap_or(usize::MAX),
                seed: args.seed,
            };
            let outcome = run_open_loop(client, workload, shape, plan).await?;
            let load = LoadShape::Open {
                rate,
                max_outstanding: args.max_outstanding,
            };
            (outcome, load)
        }
        None => {
            let concurrency = usize::try_from(args.concurrency).unwrap_or(usize::MAX);
            let outcome = run_closed_loop(client, workload, concurrency, plan).await?;
            let load = LoadShape::Closed {
                concurrency: args.concurrency,
            };
            (outcome, load)
        }
    };
    let info = RunInfo {
        url: args.url.clone(),
        endpoint: args.endpoint.name().to_owned(),
        model: args.model.clone(),
        stream: args.stream,
        http2: args.http2,
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        load,
        warmup_s: args.warmup.as_secs_f64(),
    };
    let wall = started.elapsed().as_secs_f64();
    let client_cpu_percent = match (cpu_at_start, process_cpu_time()) {
        (Some(before), Some(after)) if wall > 0.0 => {
            Some(after.saturating_sub(before).as_secs_f64() / wall * 100.0)
        }
        _ => None,
    };
    Ok(Report::new(info, &outcome, client_cpu_percent))
}

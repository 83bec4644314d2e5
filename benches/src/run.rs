//! One benchmark run from command-line arguments to report.

use std::sync::Arc;
use std::time::Instant;

use http::HeaderValue;

use crate::arrival::ArrivalPlan;
use crate::cache_report::CacheReport;
use crate::chat::{ChatSpec, chat_schedule};
use crate::cli::Args;
use crate::client::Client;
use crate::closed_loop::run_closed_loop;
use crate::connection::Connector;
use crate::engine_metrics::{EngineDelta, EngineProbe, ScrapeError, scrape_all};
use crate::open_loop::{OpenLoop, run_open_loop};
use crate::oracle::{OracleReport, OracleSpec};
use crate::oracle_input::{OracleInputError, chat_oracle, trace_oracle};
use crate::plan::{DriverError, Plan, Stop};
use crate::process_cpu::process_cpu_time;
use crate::report::{LoadShape, Report, RunInfo, WorkloadInfo};
use crate::scheduled::{ScheduledWorkload, TraceRequestSpec};
use crate::target::{Target, TargetError};
use crate::trace::{TraceError, TraceSlice, read_trace};
use crate::workload::{
    Endpoint, SyntheticSpec, SyntheticWorkload, Workload, WorkloadError, WorkloadKind,
};

/// Why a run could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The target URL is unusable.
    #[error(transparent)]
    Target(#[from] TargetError),
    /// The workload could not be built.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The chat workload needs an arrival rate.
    #[error("--workload chat needs --rate (requests per second)")]
    ChatRate,
    /// The oracle could not be computed.
    #[error(transparent)]
    Oracle(#[from] OracleInputError),
    /// An engine's metrics could not be read.
    #[error(transparent)]
    Scrape(#[from] ScrapeError),
    /// The API key is not a valid header value.
    #[error("the API key contains characters not allowed in a header")]
    ApiKey,
    /// A load task failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

/// A workload ready to send, with what the report says about it.
struct Prepared {
    workload: Arc<dyn Workload>,
    info: WorkloadInfo,
    endpoint: Endpoint,
    /// Arrival offsets of a scheduled workload (`None`: closed loop or Poisson).
    offsets: Option<Arc<[std::time::Duration]>>,
    oracle: Option<OracleReport>,
}

/// Runs the benchmark `args` describe and returns its report.
pub async fn run(args: &Args) -> Result<Report, RunError> {
    let started = Instant::now();
    let cpu_at_start = process_cpu_time();
    let target = Target::resolve(&args.url).await?;
    let mut replicas = Vec::with_capacity(args.also_urls.len());
    for url in &args.also_urls {
        replicas.push(Target::resolve(url).await?.addr);
    }
    let prepared = prepare(args, &target)?;
    let mut probes = Vec::with_capacity(args.engine_metrics.len());
    for url in &args.engine_metrics {
        probes.push(EngineProbe::new(url).await?);
    }
    let before = scrape_all(&probes).await?;
    let authorization = args
        .api_key
        .as_ref()
        .map(|key| HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| RunError::ApiKey))
        .transpose()?;
    let client = Arc::new(Client::new(
        Connector::new(target.addr, args.http2).with_replicas(replicas),
        args.timeout,
        target.host_header(),
        authorization,
    ));
    let max_outstanding = usize::try_from(args.max_outstanding).unwrap_or(usize::MAX);
    let (outcome, load) = match (&prepared.offsets, args.rate) {
        (Some(offsets), _) => {
            let requests = offsets.len() as u64;
            let plan = Plan {
                warmup: std::time::Duration::ZERO,
                stop: Stop::Requests(requests),
            };
            let shape = OpenLoop {
                arrivals: ArrivalPlan::Offsets(offsets.clone()),
                max_outstanding,
            };
            let load = LoadShape::Scheduled {
                requests,
                span_s: offsets.last().map_or(0.0, |d| d.as_secs_f64()),
                max_outstanding: args.max_outstanding,
            };
            let outcome = run_open_loop(client, prepared.workload.clone(), shape, plan).await?;
            (outcome, load)
        }
        (None, Some(rate)) => {
            let shape = OpenLoop {
                arrivals: ArrivalPlan::Poisson {
                    rate,
                    seed: args.seed,
                },
                max_outstanding,
            };
            let outcome =
                run_open_loop(client, prepared.workload.clone(), shape, fixed_plan(args)).await?;
            let load = LoadShape::Open {
                rate,
                max_outstanding: args.max_outstanding,
            };
            (outcome, load)
        }
        (None, None) => {
            let concurrency = usize::try_from(args.concurrency).unwrap_or(usize::MAX);
            let outcome = run_closed_loop(
                client,
                prepared.workload.clone(),
                concurrency,
                fixed_plan(args),
            )
            .await?;
            let load = LoadShape::Closed {
                concurrency: args.concurrency,
            };
            (outcome, load)
        }
    };
    let cache = if probes.is_empty() {
        None
    } else {
        let after = scrape_all(&probes).await?;
        let engines = probes
            .iter()
            .zip(before.iter().zip(&after))
            .map(|(probe, (b, a))| EngineDelta::between(probe.url(), b, a))
            .collect();
        Some(CacheReport::new(engines, prepared.oracle))
    };
    let info = RunInfo {
        url: args.url.clone(),
        endpoint: prepared.endpoint.name().to_owned(),
        model: args.model.clone(),
        stream: args.stream,
        http2: args.http2,
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        workload: prepared.info,
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
    Ok(Report::new(info, &outcome, client_cpu_percent).with_cache(cache))
}

/// Warm-up and stop condition of a fixed-prompt run.
fn fixed_plan(args: &Args) -> Plan {
    Plan {
        warmup: args.warmup,
        stop: args
            .requests
            .map_or(Stop::After(args.duration), Stop::Requests),
    }
}

/// The oracle's fleet: `--oracle-engines`, else one engine per `--engine-metrics` URL.
fn oracle_spec(args: &Args) -> Option<OracleSpec> {
    let engines = args
        .oracle_engines
        .or((!args.engine_metrics.is_empty()).then_some(args.engine_metrics.len()))?;
    Some(OracleSpec {
        block_size: args.block_size,
        engines,
        blocks_per_engine: args.oracle_blocks_per_engine,
    })
}

/// Builds the workload (and for trace and chat, the oracle over it) before any load is sent.
fn prepare(args: &Args, target: &Target) -> Result<Prepared, RunError> {
    match args.workload {
        WorkloadKind::Fixed => {
            let spec = SyntheticSpec {
                endpoint: args.endpoint,
                model: args.model.clone(),
                prompt_words: args.prompt_tokens,
                max_tokens: args.max_tokens,
                stream: args.stream,
                seed: args.seed,
                distinct: args.distinct_prompts,
            };
            Ok(Prepared {
                workload: Arc::new(SyntheticWorkload::new(&spec, target, args.http2)?),
                info: WorkloadInfo::Fixed,
                endpoint: args.endpoint,
                offsets: None,
                oracle: None,
            })
        }
        WorkloadKind::Trace => {
            let path = args.trace.clone().unwrap_or_default();
            let slice = TraceSlice {
                skip: args.skip_seconds,
                requests: args
                    .slice_requests
                    .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
                span: args.slice_seconds,
            };
            let records = read_trace(&path, slice, args.trace_block_size)?;
            let spec = TraceRequestSpec {
                model: args.model.clone(),
                stream: args.stream,
                format: args.prompt_format,
                trace_block_size: args.trace_block_size,
                time_scale: args.time_scale,
            };
            let workload = ScheduledWorkload::from_trace(&records, &spec, target, args.http2)?;
            let oracle = oracle_spec(args)
                .map(|spec| trace_oracle(&records, args.trace_block_size, spec))
                .transpose()?;
            let n = records.len() as f64;
            let first = records.first().map_or(0, |r| r.timestamp);
            let last = records.last().map_or(0, |r| r.timestamp);
            let info = WorkloadInfo::Trace {
                path: path.display().to_string(),
                requests: records.len() as u64,
                skipped_s: args.skip_seconds.map_or(0.0, |d| d.as_secs_f64()),
                trace_span_s: (last - first) as f64 / 1000.0,
                time_scale: args.time_scale,
                prompt_format: args.prompt_format.name(),
                mean_input_tokens: records.iter().map(|r| r.input_length as f64).sum::<f64>() / n,
                mean_output_tokens: records
                    .iter()
                    .map(|r| f64::from(r.output_length.max(1)))
                    .sum::<f64>()
                    / n,
            };
            Ok(Prepared {
                offsets: Some(workload.offsets()),
                workload: Arc::new(workload),
                info,
                endpoint: Endpoint::Completions,
                oracle,
            })
        }
        WorkloadKind::Chat => {
            let rate = args.rate.ok_or(RunError::ChatRate)?;
            let spec = ChatSpec {
                sessions: args.chat_sessions,
                active_sessions: args.chat_active_sessions,
                turns: args.chat_turns,
                system_prompts: args.chat_system_prompts,
                system_words: args.chat_system_words,
                user_words: args.chat_user_words,
                answer_words: args.chat_answer_words,
                rate,
                seed: args.seed,
            };
            let turns = chat_schedule(&spec);
            let workload = ScheduledWorkload::from_chat(
                &turns,
                &args.model,
                args.max_tokens,
                args.stream,
                target,
                args.http2,
            )?;
            let oracle = match (oracle_spec(args), &args.tokenizer) {
                (Some(spec), Some(dir)) => Some(chat_oracle(&workload, dir, spec)?),
                _ => None,
            };
            let info = WorkloadInfo::Chat {
                sessions: spec.sessions,
                active_sessions: spec.active_sessions,
                turns: spec.turns,
                system_prompts: spec.system_prompts,
                system_words: spec.system_words,
                user_words: spec.user_words,
                answer_words: spec.answer_words,
                rate,
            };
            Ok(Prepared {
                offsets: Some(workload.offsets()),
                workload: Arc::new(workload),
                info,
                endpoint: Endpoint::Chat,
                oracle,
            })
        }
    }
}

//! The results of a run: a human table and the same numbers as JSON.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use crate::cache_report::CacheReport;
use crate::histogram::Percentiles;
use crate::plan::Outcome;
use crate::recorder::PromptUsage;

/// How load was applied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LoadShape {
    /// A fixed number of connections sending back to back.
    Closed {
        /// Connections.
        concurrency: u64,
    },
    /// Poisson arrivals at a mean rate.
    Open {
        /// Offered requests per second.
        rate: f64,
        /// Bound on requests in flight.
        max_outstanding: u64,
    },
    /// Each request once, at its scheduled arrival time (trace replay, synthetic chat).
    Scheduled {
        /// Requests scheduled.
        requests: u64,
        /// From the first to the last arrival, seconds.
        span_s: f64,
        /// Bound on requests in flight.
        max_outstanding: u64,
    },
}

/// What was sent, beyond the endpoint.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkloadInfo {
    /// One deterministic prompt, over and over.
    Fixed,
    /// A Mooncake trace replay.
    Trace {
        /// The trace file.
        path: String,
        /// Requests replayed.
        requests: u64,
        /// Trace time left out before the first request replayed (`--skip-seconds`), seconds.
        skipped_s: f64,
        /// Trace time from the first to the last request, seconds.
        trace_span_s: f64,
        /// Arrival times were divided by this.
        time_scale: f64,
        /// `ids` or `text`.
        prompt_format: &'static str,
        /// Mean prompt tokens.
        mean_input_tokens: f64,
        /// Mean `max_tokens`.
        mean_output_tokens: f64,
    },
    /// Synthetic multi-turn chat.
    Chat {
        /// Conversations.
        sessions: usize,
        /// Conversations open at once.
        active_sessions: usize,
        /// User turns per conversation.
        turns: usize,
        /// Distinct system prompts.
        system_prompts: usize,
        /// Words per system prompt.
        system_words: usize,
        /// Words per user message.
        user_words: usize,
        /// Words per synthetic answer in the history.
        answer_words: usize,
        /// Mean arrival rate, requests per second.
        rate: f64,
    },
}

/// What was run, as echoed in the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunInfo {
    /// Base URL.
    pub url: String,
    /// `chat` or `completions`.
    pub endpoint: String,
    /// Model name sent.
    pub model: String,
    /// Streaming requests.
    pub stream: bool,
    /// HTTP/2 (h2c) instead of HTTP/1.1.
    pub http2: bool,
    /// Prompt length in words.
    pub prompt_tokens: usize,
    /// `max_tokens` sent.
    pub max_tokens: u32,
    /// What was sent.
    pub workload: WorkloadInfo,
    /// How load was applied.
    pub load: LoadShape,
    /// Warm-up before measuring, seconds.
    pub warmup_s: f64,
}

/// Results of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// What was run.
    #[serde(flatten)]
    pub run: RunInfo,
    /// Length of the measurement window, seconds.
    pub duration_s: f64,
    /// Successful requests.
    pub requests_ok: u64,
    /// Failed requests.
    pub errors_total: u64,
    /// Failed requests by kind (`status_503`, `connect`, `timeout`, `io`, ...).
    pub errors: BTreeMap<String, u64>,
    /// Successful requests per second.
    pub requests_per_s: f64,
    /// Generated tokens over successful requests.
    pub output_tokens: u64,
    /// Generated tokens per second.
    pub output_tokens_per_s: f64,
    /// Time to first token, ms (streaming only).
    pub ttft_ms: Option<Percentiles>,
    /// Inter-token latency, ms (streaming only).
    pub itl_ms: Option<Percentiles>,
    /// End-to-end latency, ms.
    pub e2e_ms: Option<Percentiles>,
    /// CPU the load generator used over the whole run, in % of one core (Linux only): near
    /// 100 × its threads means the generator, not the server, was the limit.
    pub client_cpu_percent: Option<f64>,
    /// The TTFT distribution as `[quantile, ms]` points, for CDF plots (streaming only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ttft_cdf_ms: Vec<[f64; 2]>,
    /// What the responses' usage said about their prompts (only when some reported it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageReport>,
    /// Engines' prefix-cache hits and the oracle's (with `--engine-metrics`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheReport>,
}

/// Prompt tokens and prefix-cache hits as each response's own `usage` reported them: the
/// engine's account of every request, summed on the client side (so it holds whatever sits
/// between the client and the engines, and needs no access to the engines' metrics).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct UsageReport {
    /// Successful requests whose usage reported `prompt_tokens`.
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Requests that also reported `prompt_tokens_details.cached_tokens`.
    pub requests_with_cached: u64,
    /// Cached prompt tokens those requests reported.
    pub cached_tokens: u64,
    /// `cached_tokens` ÷ the prompt tokens of the requests that reported it (null if none did).
    pub cached_share: Option<f64>,
}

impl UsageReport {
    /// The report of `usage`, or `None` if no response reported prompt tokens.
    pub fn new(usage: &PromptUsage) -> Option<Self> {
        (usage.requests > 0).then(|| Self {
            requests: usage.requests,
            prompt_tokens: usage.prompt_tokens,
            requests_with_cached: usage.requests_with_cached,
            cached_tokens: usage.cached_tokens,
            cached_share: usage.cached_share(),
        })
    }
}

impl Report {
    /// The report of `outcome`, with the generator's CPU use if it was measured.
    pub fn new(run: RunInfo, outcome: &Outcome, client_cpu_percent: Option<f64>) -> Self {
        let r = &outcome.recorder;
        let seconds = outcome.window.as_secs_f64();
        let per_second = |n: u64| {
            if seconds > 0.0 {
                n as f64 / seconds
            } else {
                0.0
            }
        };
        Self {
            run,
            duration_s: seconds,
            requests_ok: r.ok,
            errors_total: r.error_total(),
            errors: r.errors.iter().map(|(k, n)| (k.to_string(), *n)).collect(),
            requests_per_s: per_second(r.ok),
            output_tokens: r.output_tokens,
            output_tokens_per_s: per_second(r.output_tokens),
            ttft_ms: r.ttft.summary(),
            itl_ms: r.itl.summary(),
            e2e_ms: r.e2e.summary(),
            client_cpu_percent,
            ttft_cdf_ms: r.ttft.cdf(),
            usage: UsageReport::new(&r.usage),
            cache: None,
        }
    }

    /// The report with its prefix-cache results.
    pub fn with_cache(mut self, cache: Option<CacheReport>) -> Self {
        self.cache = cache;
        self
    }
}

/// Writes the workload line of the table.
fn write_workload(f: &mut fmt::Formatter<'_>, workload: &WorkloadInfo) -> fmt::Result {
    match workload {
        WorkloadInfo::Fixed => Ok(()),
        WorkloadInfo::Trace {
            path,
            requests,
            skipped_s,
            trace_span_s,
            time_scale,
            prompt_format,
            mean_input_tokens,
            mean_output_tokens,
        } => writeln!(
            f,
            "trace {path}: {requests} requests over {trace_span_s:.1} s of trace time from {skipped_s:.0} s at {time_scale}x, \
             prompts as {prompt_format}, mean {mean_input_tokens:.0} in / {mean_output_tokens:.0} out tokens"
        ),
        WorkloadInfo::Chat {
            sessions,
            active_sessions,
            turns,
            system_prompts,
            system_words,
            user_words,
            answer_words,
            rate,
        } => writeln!(
            f,
            "chat: {sessions} sessions × {turns} turns, {active_sessions} open at once, \
             {system_prompts} system prompts of {system_words} words, user {user_words} words, \
             answers {answer_words} words, {rate} req/s Poisson"
        ),
    }
}

/// Writes the prefix-cache lines of the table.
fn write_cache(f: &mut fmt::Formatter<'_>, cache: &CacheReport) -> fmt::Result {
    write!(
        f,
        "prefix cache: fleet hit rate {:.4} ({} of {} prompt tokens), {} preemptions, \
         requests per engine {}–{}",
        cache.hit_rate,
        cache.hit_tokens,
        cache.query_tokens,
        cache.preemptions,
        cache.requests_min,
        cache.requests_max
    )?;
    match (&cache.oracle, cache.fraction_of_oracle) {
        (Some(o), fraction) => {
            writeln!(
                f,
                "\noracle ({} blocks of {} tokens): hit rate {:.4}, infinite cache {:.4}{}",
                o.capacity_blocks,
                o.block_size,
                o.hit_rate,
                o.infinite_hit_rate,
                fraction.map_or(String::new(), |x| format!(
                    "; measured = {:.1} % of the oracle",
                    x * 100.0
                ))
            )?;
        }
        (None, _) => writeln!(f)?,
    }
    writeln!(
        f,
        "{:<28}{:>10}{:>16}{:>16}{:>10}{:>12}",
        "engine", "requests", "query tokens", "hit tokens", "hit rate", "preempted"
    )?;
    for e in &cache.engines {
        writeln!(
            f,
            "{:<28}{:>10}{:>16}{:>16}{:>10.4}{:>12}",
            e.url, e.requests, e.query_tokens, e.hit_tokens, e.hit_rate, e.preemptions
        )?;
    }
    Ok(())
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let run = &self.run;
        let load = match run.load {
            LoadShape::Closed { concurrency } => format!("closed loop, {concurrency} connections"),
            LoadShape::Open {
                rate,
                max_outstanding,
            } => format!("open loop, {rate} req/s offered, at most {max_outstanding} outstanding"),
            LoadShape::Scheduled {
                requests,
                span_s,
                max_outstanding,
            } => format!(
                "scheduled arrivals, {requests} requests over {span_s:.2} s, at most {max_outstanding} outstanding"
            ),
        };
        writeln!(
            f,
            "{} {} model={} stream={} http2={} prompt={}w max_tokens={}",
            run.url,
            run.endpoint,
            run.model,
            run.stream,
            run.http2,
            run.prompt_tokens,
            run.max_tokens
        )?;
        write_workload(f, &run.workload)?;
        writeln!(
            f,
            "{load}; measured {:.2} s after {:.2} s warm-up",
            self.duration_s, run.warmup_s
        )?;
        writeln!(
            f,
            "requests: {} ok, {} errors | {:.1} req/s | {:.1} output tok/s ({} tokens)",
            self.requests_ok,
            self.errors_total,
            self.requests_per_s,
            self.output_tokens_per_s,
            self.output_tokens
        )?;
        writeln!(
            f,
            "{:<12}{:>10}{:>10}{:>10}{:>10}{:>10}{:>12}",
            "latency ms", "p50", "p90", "p99", "max", "mean", "count"
        )?;
        for (name, p) in [
            ("TTFT", &self.ttft_ms),
            ("ITL", &self.itl_ms),
            ("E2E", &self.e2e_ms),
        ] {
            match p {
                Some(p) => writeln!(
                    f,
                    "{name:<12}{:>10.3}{:>10.3}{:>10.3}{:>10.3}{:>10.3}{:>12}",
                    p.p50, p.p90, p.p99, p.max, p.mean, p.count
                )?,
                None => writeln!(f, "{name:<12}{:>10}", "-")?,
            }
        }
        if let Some(u) = &self.usage {
            write!(
                f,
                "usage: {} prompt tokens over {} requests",
                u.prompt_tokens, u.requests
            )?;
            match u.cached_share {
                Some(share) => writeln!(
                    f,
                    "; cached_tokens {} ({:.4} of the prompt tokens of the {} requests reporting it)",
                    u.cached_tokens, share, u.requests_with_cached
                )?,
                None => writeln!(f, "; no cached_tokens reported")?,
            }
        }
        if let Some(cache) = &self.cache {
            write_cache(f, cache)?;
        }
        if let Some(cpu) = self.client_cpu_percent {
            writeln!(f, "load generator CPU: {cpu:.0}% of one core")?;
        }
        if !self.errors.is_empty() {
            let kinds: Vec<String> = self
                .errors
                .iter()
                .map(|(k, n)| format!("{k}={n}"))
                .collect();
            writeln!(f, "errors: {}", kinds.join(" "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error_kind::ErrorKind;
    use crate::recorder::{Completed, Recorder};
    use std::time::{Duration, Instant};

    fn info() -> RunInfo {
        RunInfo {
            url: "http://127.0.0.1:1".into(),
            endpoint: "chat".into(),
            model: "m".into(),
            stream: true,
            http2: false,
            prompt_tokens: 16,
            max_tokens: 16,
            workload: WorkloadInfo::Fixed,
            load: LoadShape::Closed { concurrency: 4 },
            warmup_s: 0.0,
        }
    }

    #[test]
    fn rates_and_json_fields() {
        let mut recorder = Recorder::new();
        let now = Instant::now();
        for _ in 0..20 {
            let done = Completed {
                ttft: Some(Duration::from_micros(500)),
                e2e: Duration::from_millis(2),
                output_tokens: 16,
                prompt_tokens: Some(40),
                cached_tokens: Some(30),
                finished_at: now,
            };
            recorder.record_success(&done, &[100, 100]);
        }
        recorder.record_error(ErrorKind::Status(429), now);
        let outcome = Outcome {
            recorder,
            window: Duration::from_secs(2),
        };
        let report = Report::new(info(), &outcome, Some(40.0));
        assert_eq!(report.requests_per_s, 10.0);
        assert_eq!(report.output_tokens_per_s, 160.0);
        let json = serde_json::to_value(&report).expect("serialisable");
        assert_eq!(json["errors"]["status_429"], 1);
        assert_eq!(json["load"]["kind"], "closed");
        assert_eq!(json["ttft_ms"]["p50"], 0.5);
        assert_eq!(json["itl_ms"]["count"], 40);
        assert_eq!(json["url"], "http://127.0.0.1:1");
        let table = report.to_string();
        assert!(table.contains("10.0 req/s"), "{table}");
        assert!(table.contains("status_429=1"), "{table}");
        assert!(table.contains("CPU: 40% of one core"), "{table}");
        assert_eq!(json["client_cpu_percent"], 40.0);
        assert_eq!(json["workload"]["kind"], "fixed");
        assert_eq!(json["ttft_cdf_ms"][50][1], 0.5);
        assert!(json.get("cache").is_none());
        assert_eq!(json["usage"]["requests"], 20);
        assert_eq!(json["usage"]["prompt_tokens"], 800);
        assert_eq!(json["usage"]["cached_tokens"], 600);
        assert_eq!(json["usage"]["cached_share"], 0.75);
        assert!(
            table.contains("cached_tokens 600 (0.7500 of the prompt tokens of the 20 requests"),
            "{table}"
        );
    }

    #[test]
    fn cache_results_appear_in_json_and_table() {
        use crate::engine_metrics::EngineDelta;
        let engines = vec![EngineDelta {
            url: "http://127.0.0.1:9".into(),
            requests: 3,
            query_tokens: 1000,
            hit_tokens: 250,
            hit_rate: 0.25,
            preemptions: 0,
        }];
        let oracle = crate::oracle::OracleReport {
            model: "pooled LRU",
            block_size: 64,
            capacity_blocks: 128,
            requests: 3,
            prompt_tokens: 1000,
            hit_tokens: 500,
            hit_rate: 0.5,
            infinite_hit_tokens: 600,
            infinite_hit_rate: 0.6,
        };
        let outcome = Outcome {
            recorder: Recorder::new(),
            window: Duration::from_secs(1),
        };
        let mut run = info();
        run.workload = WorkloadInfo::Trace {
            path: "t.jsonl".into(),
            requests: 3,
            skipped_s: 0.0,
            trace_span_s: 2.0,
            time_scale: 4.0,
            prompt_format: "ids",
            mean_input_tokens: 333.0,
            mean_output_tokens: 10.0,
        };
        run.load = LoadShape::Scheduled {
            requests: 3,
            span_s: 0.5,
            max_outstanding: 8,
        };
        let report = Report::new(run, &outcome, None)
            .with_cache(Some(CacheReport::new(engines, Some(oracle))));
        let json = serde_json::to_value(&report).expect("serialisable");
        assert_eq!(json["cache"]["hit_rate"], 0.25);
        assert_eq!(json["cache"]["fraction_of_oracle"], 0.5);
        assert_eq!(json["cache"]["oracle"]["infinite_hit_rate"], 0.6);
        assert_eq!(json["workload"]["kind"], "trace");
        assert_eq!(json["load"]["kind"], "scheduled");
        let table = report.to_string();
        assert!(table.contains("fleet hit rate 0.2500"), "{table}");
        assert!(table.contains("50.0 % of the oracle"), "{table}");
        assert!(table.contains("trace t.jsonl: 3 requests"), "{table}");
    }

    #[test]
    fn empty_window_reports_zero_rates() {
        let outcome = Outcome {
            recorder: Recorder::new(),
            window: Duration::ZERO,
        };
        let report = Report::new(info(), &outcome, Some(40.0));
        assert_eq!(report.requests_per_s, 0.0);
        assert_eq!(report.e2e_ms, None);
        let json = serde_json::to_value(&report).expect("serialisable");
        assert!(json.get("usage").is_none());
    }
}

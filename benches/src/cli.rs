//! Command-line arguments of `kvmesh-bench`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::scheduled::PromptFormat;
use crate::workload::{Endpoint, WorkloadKind};

/// Load generator for OpenAI-compatible HTTP endpoints: closed or open loop, streaming-aware;
/// fixed prompts, Mooncake trace replay or synthetic multi-turn chat, with engine prefix-cache
/// hit rates and the oracle's.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvmesh-bench", version, about)]
pub struct Args {
    /// What to send: `fixed` (one prompt over and over, closed or open loop), `trace` (replay a
    /// Mooncake trace at its own arrival times) or `chat` (synthetic multi-turn chat sessions,
    /// Poisson arrivals at `--rate`). `trace` and `chat` send every request once, open loop.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Fixed)]
    pub workload: WorkloadKind,
    /// Trace: the Mooncake JSONL file to replay (token-id prompts to `/v1/completions`).
    #[arg(long, required_if_eq("workload", "trace"))]
    pub trace: Option<PathBuf>,
    /// Trace: arrival times are divided by this (2 replays twice as fast as recorded).
    #[arg(long, default_value_t = 1.0, value_parser = parse_rate)]
    pub time_scale: f64,
    /// Trace: leave out the requests that arrive sooner than this after the trace's first (trace
    /// time, e.g. `1768s` for the second half of a 3,537 s trace); the other slice options count
    /// from the first request left.
    #[arg(long, value_parser = parse_duration)]
    pub skip_seconds: Option<Duration>,
    /// Trace: replay only the first N requests.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub slice_requests: Option<u64>,
    /// Trace: replay only the requests within this long of the first (trace time, e.g. `300s`).
    #[arg(long, value_parser = parse_duration)]
    pub slice_seconds: Option<Duration>,
    /// Trace: tokens per trace hash id.
    #[arg(long, default_value_t = crate::trace::MOONCAKE_BLOCK_SIZE, value_parser = parse_positive)]
    pub trace_block_size: usize,
    /// Trace: send prompts as token-id arrays (`ids`) or as text with one number word per token
    /// (`text`, for routers that reject token ids; a word-splitting engine tokenizer gives the
    /// same token count and prefix structure).
    #[arg(long, value_enum, default_value_t = PromptFormat::Ids)]
    pub prompt_format: PromptFormat,
    /// Chat: conversations in total.
    #[arg(long, default_value_t = 64, value_parser = parse_positive)]
    pub chat_sessions: usize,
    /// Chat: conversations open at once; each arrival is the next turn of one of them.
    #[arg(long, default_value_t = 16, value_parser = parse_positive)]
    pub chat_active_sessions: usize,
    /// Chat: user turns per conversation.
    #[arg(long, default_value_t = 4, value_parser = parse_positive)]
    pub chat_turns: usize,
    /// Chat: distinct system prompts, shared round robin by the conversations.
    #[arg(long, default_value_t = 4, value_parser = parse_positive)]
    pub chat_system_prompts: usize,
    /// Chat: words per system prompt.
    #[arg(long, default_value_t = 1000)]
    pub chat_system_words: usize,
    /// Chat: words per user message.
    #[arg(long, default_value_t = 64)]
    pub chat_user_words: usize,
    /// Chat: words per synthetic assistant answer placed in the history.
    #[arg(long, default_value_t = 64)]
    pub chat_answer_words: usize,
    /// Base URLs of the engines behind the target, whose `/metrics` (vLLM names) are read
    /// before and after the run for per-engine prefix-cache hit rates (comma-separated or
    /// repeated).
    #[arg(long, value_delimiter = ',')]
    pub engine_metrics: Vec<String>,
    /// Oracle: engines of the fleet (default: the number of `--engine-metrics` URLs; no
    /// oracle when both are absent).
    #[arg(long, value_parser = parse_positive)]
    pub oracle_engines: Option<usize>,
    /// Oracle: KV capacity of one engine in blocks (vLLM `num_gpu_blocks`).
    #[arg(long, default_value_t = 16_384, value_parser = parse_positive)]
    pub oracle_blocks_per_engine: usize,
    /// Oracle: the engines' KV block size in tokens.
    #[arg(long, default_value_t = 64, value_parser = parse_positive)]
    pub block_size: usize,
    /// Chat oracle: directory with the engines' `tokenizer.json` and `tokenizer_config.json`
    /// (chat template), to count prompt tokens as the engines do; without it a chat run
    /// reports no oracle.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Base URL of the server (plain http; a trailing `/v1` is allowed).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Another server answering the same API (a replica of `--url`): new connections go to
    /// each in turn. Repeatable.
    #[arg(long = "also-url")]
    pub also_urls: Vec<String>,
    /// Endpoint to call.
    #[arg(long, value_enum, default_value_t = Endpoint::Chat)]
    pub endpoint: Endpoint,
    /// `model` field of every request.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Prompt length: a deterministic prompt of this many words (about one token each).
    #[arg(long, default_value_t = 16)]
    pub prompt_tokens: usize,
    /// Fixed: this many distinct prompts (seeds `--seed`, `--seed`+1, ...), sent in turn, so a
    /// router's caches see each again only after all the others (1: the same prompt always).
    #[arg(long, default_value_t = 1, value_parser = parse_positive)]
    pub distinct_prompts: usize,
    /// `max_tokens` of every request.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Ask for streamed (SSE) responses and measure TTFT and inter-token gaps.
    #[arg(long)]
    pub stream: bool,
    /// Closed loop: connections, each sending back to back.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub concurrency: u64,
    /// Open loop: mean arrival rate in requests per second (Poisson arrivals).
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// Open loop: most requests in flight at once.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_outstanding: u64,
    /// Measure for this long (e.g. `10s`, `500ms`, `2m`).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Measure this many requests instead of a duration.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,
    /// Apply load without recording for this long first.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub warmup: Duration,
    /// Per-request timeout, from sending to the end of the response.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Speak HTTP/2 with prior knowledge (h2c) over one multiplexed connection.
    #[arg(long)]
    pub http2: bool,
    /// Seed of the prompt words and of the arrival gaps.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Send `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Runtime worker threads (default: the CPUs this process may run on).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub threads: Option<u64>,
}

/// Parses `10s`, `250ms`, `2m`, `1.5s` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = text.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("invalid duration {text:?} (e.g. 10s, 500ms, 2m)"))?;
    Duration::try_from_secs_f64(value * scale)
        .map_err(|_| format!("invalid duration {text:?}: must be finite and not negative"))
}

/// Parses a positive integer.
pub fn parse_positive(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("invalid value {text:?}: a positive integer")),
    }
}

/// Parses a positive, finite rate in requests per second.
pub fn parse_rate(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 => Ok(rate),
        _ => Err(format!(
            "invalid rate {text:?}: a positive number of requests/s"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("1000"), Ok(1000.0));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("inf").is_err());
        assert!(parse_rate("NaN").is_err());
    }

    #[test]
    fn defaults_and_flags_parse() {
        let args = Args::try_parse_from([
            "kvmesh-bench",
            "--endpoint",
            "completions",
            "--stream",
            "--requests",
            "100",
            "--rate",
            "50",
        ])
        .expect("valid arguments");
        assert_eq!(args.endpoint, Endpoint::Completions);
        assert!(args.stream);
        assert_eq!(args.requests, Some(100));
        assert_eq!(args.rate, Some(50.0));
        assert_eq!(args.concurrency, 32);
        assert!(Args::try_parse_from(["kvmesh-bench", "--concurrency", "0"]).is_err());
        assert_eq!(args.workload, WorkloadKind::Fixed);
    }

    #[test]
    fn trace_and_chat_flags_parse() {
        let args = Args::try_parse_from([
            "kvmesh-bench",
            "--workload",
            "trace",
            "--trace",
            "t.jsonl",
            "--time-scale",
            "8",
            "--slice-requests",
            "200",
            "--slice-seconds",
            "60s",
            "--prompt-format",
            "text",
            "--engine-metrics",
            "http://a:1,http://b:2",
            "--engine-metrics",
            "http://c:3",
        ])
        .expect("valid arguments");
        assert_eq!(args.workload, WorkloadKind::Trace);
        assert_eq!(args.time_scale, 8.0);
        assert_eq!(args.slice_requests, Some(200));
        assert_eq!(args.slice_seconds, Some(Duration::from_secs(60)));
        assert_eq!(args.prompt_format, PromptFormat::Text);
        assert_eq!(args.engine_metrics.len(), 3);
        assert_eq!(args.trace_block_size, 512);
        assert!(Args::try_parse_from(["kvmesh-bench", "--workload", "trace"]).is_err());
        assert!(Args::try_parse_from(["kvmesh-bench", "--chat-turns", "0"]).is_err());
        assert_eq!(parse_positive("3"), Ok(3));
        assert!(parse_positive("0").is_err());
    }
}

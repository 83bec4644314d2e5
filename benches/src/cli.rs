//! Command-line arguments of `kvmesh-bench`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::workload::Endpoint;

/// Load generator for OpenAI-compatible HTTP endpoints: closed or open loop, streaming-aware.
#[derive(Debug, Clone, Parser)]
#[command(name = "kvmesh-bench", version, about)]
pub struct Args {
    /// Base URL of the server (plain http; a trailing `/v1` is allowed).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Endpoint to call.
    #[arg(long, value_enum, default_value_t = Endpoint::Chat)]
    pub endpoint: Endpoint,
    /// `model` field of every request.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Prompt length: a deterministic prompt of this many words (about one token each).
    #[arg(long, default_value_t = 16)]
    pub prompt_tokens: usize,
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
    }
}

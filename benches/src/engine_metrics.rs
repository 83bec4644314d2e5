//! Engines' own counters, read from their Prometheus `/metrics` (vLLM names) before and after a
//! run: the prefix-cache hit rate each engine saw, and how the requests spread.

use std::time::Duration;

use bytes::Bytes;
use http::header::HOST;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use serde::Serialize;

use crate::connection::Connector;
use crate::target::{Target, TargetError};

/// Longest time one scrape may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

/// The counters of one engine at one moment (sums over all label sets).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineCounters {
    /// `vllm:prefix_cache_queries_total`: prompt tokens looked up in the prefix cache.
    pub queries: f64,
    /// `vllm:prefix_cache_hits_total`: prompt tokens found there.
    pub hits: f64,
    /// `vllm:request_success_total`: finished requests.
    pub requests: f64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: f64,
}

impl EngineCounters {
    /// Reads the counters from a Prometheus text exposition; missing ones stay 0.
    pub fn parse(text: &str) -> Self {
        let mut out = Self::default();
        for line in text.lines() {
            if line.starts_with('#') {
                continue;
            }
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let slot = match &line[..name_end] {
                "vllm:prefix_cache_queries_total" => &mut out.queries,
                "vllm:prefix_cache_hits_total" => &mut out.hits,
                "vllm:request_success_total" => &mut out.requests,
                "vllm:num_preemptions_total" => &mut out.preemptions,
                _ => continue,
            };
            if let Some(value) = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite())
            {
                *slot += value;
            }
        }
        out
    }
}

/// Failure to read an engine's metrics.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The URL is unusable.
    #[error(transparent)]
    Target(#[from] TargetError),
    /// The connection or the exchange failed.
    #[error("GET {url}/metrics failed: {message}")]
    Http {
        /// The engine's base URL.
        url: String,
        /// What went wrong.
        message: String,
    },
}

/// One engine whose `/metrics` is read.
#[derive(Debug)]
pub struct EngineProbe {
    url: String,
    target: Target,
}

impl EngineProbe {
    /// A probe of the engine at base URL `url` (e.g. `http://127.0.0.1:8000`).
    pub async fn new(url: &str) -> Result<Self, ScrapeError> {
        Ok(Self {
            url: url.trim_end_matches('/').to_owned(),
            target: Target::resolve(url).await?,
        })
    }

    /// The engine's base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Reads the engine's counters now.
    pub async fn scrape(&self) -> Result<EngineCounters, ScrapeError> {
        let failed = |message: String| ScrapeError::Http {
            url: self.url.clone(),
            message,
        };
        let exchange = async {
            let mut sender = Connector::new(self.target.addr, false)
                .connect()
                .await
                .map_err(|e| failed(e.to_string()))?;
            let uri = self.target.endpoint_uri("/metrics", false)?;
            let request = Request::builder()
                .method(Method::GET)
                .uri(uri)
                .header(HOST, self.target.host_header())
                .body(Full::new(Bytes::new()))
                .map_err(|e| failed(e.to_string()))?;
            let response = sender
                .send(request)
                .await
                .map_err(|e| failed(e.to_string()))?;
            if !response.status().is_success() {
                return Err(failed(format!("status {}", response.status())));
            }
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| failed(e.to_string()))?
                .to_bytes();
            Ok(EngineCounters::parse(&String::from_utf8_lossy(&body)))
        };
        tokio::time::timeout(SCRAPE_TIMEOUT, exchange)
            .await
            .map_err(|_| failed(format!("no answer within {SCRAPE_TIMEOUT:?}")))?
    }
}

/// Every engine's counters now, in probe order.
pub async fn scrape_all(probes: &[EngineProbe]) -> Result<Vec<EngineCounters>, ScrapeError> {
    let mut out = Vec::with_capacity(probes.len());
    for probe in probes {
        out.push(probe.scrape().await?);
    }
    Ok(out)
}

/// What one engine did during a run (counter differences).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineDelta {
    /// The engine's base URL.
    pub url: String,
    /// Requests it finished.
    pub requests: u64,
    /// Prompt tokens it looked up in its prefix cache.
    pub query_tokens: u64,
    /// Prompt tokens it found there.
    pub hit_tokens: u64,
    /// `hit_tokens / query_tokens` (0 when it saw no query).
    pub hit_rate: f64,
    /// Requests it preempted (their re-admission is queried again).
    pub preemptions: u64,
}

impl EngineDelta {
    /// The difference `after − before` for the engine at `url`.
    pub fn between(url: &str, before: &EngineCounters, after: &EngineCounters) -> Self {
        let diff = |a: f64, b: f64| (a - b).max(0.0).round() as u64;
        let query_tokens = diff(after.queries, before.queries);
        let hit_tokens = diff(after.hits, before.hits);
        Self {
            url: url.to_owned(),
            requests: diff(after.requests, before.requests),
            query_tokens,
            hit_tokens,
            hit_rate: ratio(hit_tokens, query_tokens),
            preemptions: diff(after.preemptions, before.preemptions),
        }
    }
}

/// `part / whole`, 0 when `whole` is 0.
pub fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPOSITION: &str = "\
# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name=\"m\",engine=\"0\"} 1000
vllm:prefix_cache_hits_total{model_name=\"m\",engine=\"0\"} 250.0
vllm:prefix_cache_hits_total_other 7
vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"length\"} 9
vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"stop\"} 1
vllm:num_preemptions_total{model_name=\"m\",engine=\"0\"} 2
vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3
";

    #[test]
    fn parses_and_sums_the_counters() {
        let c = EngineCounters::parse(EXPOSITION);
        assert_eq!(c.queries, 1000.0);
        assert_eq!(c.hits, 250.0);
        assert_eq!(c.requests, 10.0);
        assert_eq!(c.preemptions, 2.0);
        assert_eq!(
            EngineCounters::parse("garbage\nvllm:prefix_cache_hits_total x"),
            EngineCounters::default()
        );
    }

    #[test]
    fn deltas_and_rates() {
        let before = EngineCounters {
            queries: 100.0,
            hits: 10.0,
            requests: 1.0,
            preemptions: 0.0,
        };
        let after = EngineCounters::parse(EXPOSITION);
        let d = EngineDelta::between("http://e", &before, &after);
        assert_eq!(d.query_tokens, 900);
        assert_eq!(d.hit_tokens, 240);
        assert_eq!(d.requests, 9);
        assert_eq!(d.preemptions, 2);
        assert!((d.hit_rate - 240.0 / 900.0).abs() < 1e-12);
        let idle = EngineDelta::between("http://e", &after, &after);
        assert_eq!(idle.hit_rate, 0.0);
    }
}

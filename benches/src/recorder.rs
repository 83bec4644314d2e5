//! Per-lane accumulation of request outcomes, merged at the end of a run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::error_kind::ErrorKind;
use crate::histogram::LatencyHistogram;

/// A successful request, as measured by the client.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Completed {
    /// Time to the first content event (streaming requests only).
    pub ttft: Option<Duration>,
    /// Time to the end of the response body.
    pub e2e: Duration,
    /// Generated tokens: the reported usage, else the number of content events.
    pub output_tokens: u64,
    /// `usage.prompt_tokens`, when the response reported it.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when the response reported it.
    pub cached_tokens: Option<u64>,
    /// When the response ended.
    pub finished_at: Instant,
}

/// What the responses' own usage said about their prompts: how many prompt tokens the
/// engines reported, and how many of those they served from their prefix caches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptUsage {
    /// Successful requests whose usage reported `prompt_tokens`.
    pub requests: u64,
    /// Their `prompt_tokens`, summed.
    pub prompt_tokens: u64,
    /// Of those, requests that also reported `prompt_tokens_details.cached_tokens`.
    pub requests_with_cached: u64,
    /// `prompt_tokens` of the requests that reported `cached_tokens`, summed.
    pub prompt_tokens_with_cached: u64,
    /// Their `cached_tokens`, summed.
    pub cached_tokens: u64,
}

impl PromptUsage {
    /// Adds one response's usage.
    pub fn add(&mut self, prompt_tokens: Option<u64>, cached_tokens: Option<u64>) {
        let Some(prompt) = prompt_tokens else { return };
        self.requests += 1;
        self.prompt_tokens += prompt;
        if let Some(cached) = cached_tokens {
            self.requests_with_cached += 1;
            self.prompt_tokens_with_cached += prompt;
            self.cached_tokens += cached;
        }
    }

    /// Adds everything `other` counted.
    pub fn merge(&mut self, other: &Self) {
        self.requests += other.requests;
        self.prompt_tokens += other.prompt_tokens;
        self.requests_with_cached += other.requests_with_cached;
        self.prompt_tokens_with_cached += other.prompt_tokens_with_cached;
        self.cached_tokens += other.cached_tokens;
    }

    /// `cached_tokens / prompt_tokens` over the responses that reported both, if any did.
    pub fn cached_share(&self) -> Option<f64> {
        (self.prompt_tokens_with_cached > 0)
            .then(|| self.cached_tokens as f64 / self.prompt_tokens_with_cached as f64)
    }
}

/// Counts and latency distributions of the requests one lane measured.
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    /// Time to first token.
    pub ttft: LatencyHistogram,
    /// Gaps between consecutive content events of a stream.
    pub itl: LatencyHistogram,
    /// End-to-end latency.
    pub e2e: LatencyHistogram,
    /// Successful requests.
    pub ok: u64,
    /// Generated tokens over all successful requests.
    pub output_tokens: u64,
    /// The prompt usage the successful responses reported.
    pub usage: PromptUsage,
    /// Failed requests by kind.
    pub errors: BTreeMap<ErrorKind, u64>,
    /// When the last measured request ended (success or failure).
    pub last_finish: Option<Instant>,
}

impl Recorder {
    /// An empty recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a successful request and its inter-token gaps (µs).
    pub fn record_success(&mut self, done: &Completed, itl_micros: &[u64]) {
        self.ok += 1;
        self.output_tokens += done.output_tokens;
        self.usage.add(done.prompt_tokens, done.cached_tokens);
        self.e2e.record(done.e2e);
        if let Some(ttft) = done.ttft {
            self.ttft.record(ttft);
        }
        for gap in itl_micros {
            self.itl.record_micros(*gap);
        }
        self.note_finish(done.finished_at);
    }

    /// Records a failed request.
    pub fn record_error(&mut self, kind: ErrorKind, at: Instant) {
        *self.errors.entry(kind).or_insert(0) += 1;
        self.note_finish(at);
    }

    /// Adds everything `other` recorded.
    pub fn merge(&mut self, other: &Self) {
        self.ttft.merge(&other.ttft);
        self.itl.merge(&other.itl);
        self.e2e.merge(&other.e2e);
        self.ok += other.ok;
        self.output_tokens += other.output_tokens;
        self.usage.merge(&other.usage);
        for (kind, n) in &other.errors {
            *self.errors.entry(*kind).or_insert(0) += n;
        }
        if let Some(at) = other.last_finish {
            self.note_finish(at);
        }
    }

    /// Failed requests of every kind.
    pub fn error_total(&self) -> u64 {
        self.errors.values().sum()
    }

    fn note_finish(&mut self, at: Instant) {
        self.last_finish = Some(self.last_finish.map_or(at, |last| last.max(at)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completed(e2e_ms: u64, tokens: u64, at: Instant) -> Completed {
        Completed {
            ttft: Some(Duration::from_millis(1)),
            e2e: Duration::from_millis(e2e_ms),
            output_tokens: tokens,
            prompt_tokens: Some(100),
            cached_tokens: Some(64),
            finished_at: at,
        }
    }

    #[test]
    fn merge_sums_counts_and_keeps_the_latest_finish() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        let mut a = Recorder::new();
        a.record_success(&completed(2, 16, t0), &[10, 20]);
        a.record_error(ErrorKind::Status(503), t0);
        let mut b = Recorder::new();
        b.record_success(&completed(4, 16, later), &[30]);
        b.record_error(ErrorKind::Status(503), t0);
        b.record_error(ErrorKind::Timeout, t0);
        a.merge(&b);
        assert_eq!(a.ok, 2);
        assert_eq!(a.output_tokens, 32);
        assert_eq!(a.usage.requests, 2);
        assert_eq!(a.usage.prompt_tokens, 200);
        assert_eq!(a.usage.cached_tokens, 128);
        assert_eq!(a.usage.cached_share(), Some(0.64));
        assert_eq!(a.itl.count(), 3);
        assert_eq!(a.ttft.count(), 2);
        assert_eq!(a.errors[&ErrorKind::Status(503)], 2);
        assert_eq!(a.errors[&ErrorKind::Timeout], 1);
        assert_eq!(a.error_total(), 3);
        assert_eq!(a.last_finish, Some(later));
    }

    #[test]
    fn usage_counts_cached_share_only_where_reported() {
        let mut u = PromptUsage::default();
        assert_eq!(u.cached_share(), None);
        u.add(None, Some(5)); // no usage at all: not counted
        u.add(Some(100), Some(96));
        u.add(Some(50), None); // an engine without prompt-token details
        u.add(Some(300), Some(0));
        assert_eq!(u.requests, 3);
        assert_eq!(u.prompt_tokens, 450);
        assert_eq!(u.requests_with_cached, 2);
        assert_eq!(u.prompt_tokens_with_cached, 400);
        assert_eq!(u.cached_tokens, 96);
        assert_eq!(u.cached_share(), Some(0.24));
    }
}

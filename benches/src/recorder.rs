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
    /// When the response ended.
    pub finished_at: Instant,
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
        assert_eq!(a.itl.count(), 3);
        assert_eq!(a.ttft.count(), 2);
        assert_eq!(a.errors[&ErrorKind::Status(503)], 2);
        assert_eq!(a.errors[&ErrorKind::Timeout], 1);
        assert_eq!(a.error_total(), 3);
        assert_eq!(a.last_finish, Some(later));
    }
}

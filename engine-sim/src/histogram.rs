//! A lock-free Prometheus histogram (cumulative buckets rendered in text format).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Time-to-first-token buckets in seconds (vLLM's).
pub(crate) const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// Inter-token-latency buckets in seconds (vLLM's).
pub(crate) const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// End-to-end latency buckets in seconds (vLLM's request-latency buckets).
pub(crate) const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Observations of one histogram; `+Inf` is the total count.
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    counts: Box<[AtomicU64]>,
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    /// An empty histogram with the given upper bounds (ascending).
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_nanos: AtomicU64::new(0),
        }
    }

    /// Records one value in seconds.
    pub(crate) fn observe(&self, seconds: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| seconds <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        // Saturating float-to-int cast: negative values count as 0.
        self.sum_nanos
            .fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
    }

    /// Number of observations.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Appends `# HELP`, `# TYPE` and the series, `labels` being `k="v",...` without braces.
    pub(crate) fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(self.counts.iter()) {
            cumulative += count.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{bound:?}\"}} {cumulative}"
            );
        }
        let total = self.count();
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {total}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {total}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "help", "a=\"b\"");
        assert!(out.contains("x_seconds_bucket{a=\"b\",le=\"0.1\"} 1\n"));
        assert!(out.contains("x_seconds_bucket{a=\"b\",le=\"1.0\"} 2\n"));
        assert!(out.contains("x_seconds_bucket{a=\"b\",le=\"+Inf\"} 3\n"));
        assert!(out.contains("x_seconds_count{a=\"b\"} 3\n"));
        assert!(out.contains("x_seconds_sum{a=\"b\"} 5.55\n"));
        assert!(out.starts_with("# HELP x_seconds help\n# TYPE x_seconds histogram\n"));
    }
}

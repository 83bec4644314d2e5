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
/// Fine inter-token-latency buckets in seconds (the simulator's own): every millisecond to
/// 60 ms, every 5 ms to 200 ms, then coarser, so a p99 reads to the millisecond where
/// vLLM's buckets are 25 ms apart.
pub(crate) const FINE_ITL_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.011, 0.012, 0.013,
    0.014, 0.015, 0.016, 0.017, 0.018, 0.019, 0.02, 0.021, 0.022, 0.023, 0.024, 0.025, 0.026,
    0.027, 0.028, 0.029, 0.03, 0.031, 0.032, 0.033, 0.034, 0.035, 0.036, 0.037, 0.038, 0.039, 0.04,
    0.041, 0.042, 0.043, 0.044, 0.045, 0.046, 0.047, 0.048, 0.049, 0.05, 0.051, 0.052, 0.053,
    0.054, 0.055, 0.056, 0.057, 0.058, 0.059, 0.06, 0.065, 0.07, 0.075, 0.08, 0.085, 0.09, 0.095,
    0.1, 0.105, 0.11, 0.115, 0.12, 0.125, 0.13, 0.135, 0.14, 0.145, 0.15, 0.155, 0.16, 0.165, 0.17,
    0.175, 0.18, 0.185, 0.19, 0.195, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
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

    /// Appends the `# HELP` and `# TYPE` lines of histogram `name`.
    pub(crate) fn render_header(out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    }

    /// Appends this histogram's series of `name`, `labels` being `k="v",...` without braces.
    pub(crate) fn render_series(&self, out: &mut String, name: &str, labels: &str) {
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
        Histogram::render_header(&mut out, "x_seconds", "help");
        h.render_series(&mut out, "x_seconds", "a=\"b\"");
        assert!(out.contains("x_seconds_bucket{a=\"b\",le=\"0.1\"} 1\n"));
        assert!(out.contains("x_seconds_bucket{a=\"b\",le=\"1.0\"} 2\n"));
        assert!(out.contains("x_seconds_bucket{a=\"b\",le=\"+Inf\"} 3\n"));
        assert!(out.contains("x_seconds_count{a=\"b\"} 3\n"));
        assert!(out.contains("x_seconds_sum{a=\"b\"} 5.55\n"));
        assert!(out.starts_with("# HELP x_seconds help\n# TYPE x_seconds histogram\n"));
    }
}

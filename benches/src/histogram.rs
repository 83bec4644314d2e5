//! Latency histograms in microseconds and their percentile summaries in milliseconds.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Highest recordable latency: one hour, in microseconds (longer values saturate).
const MAX_MICROS: u64 = 3_600_000_000;
/// Significant decimal digits kept: 3 gives 0.1 % relative precision.
const SIGNIFICANT_DIGITS: u8 = 3;

/// A latency distribution with microsecond resolution.
#[derive(Debug, Clone)]
pub struct LatencyHistogram {
    micros: Histogram<u64>,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyHistogram {
    /// An empty histogram covering 1 µs to one hour.
    pub fn new() -> Self {
        let micros = Histogram::new_with_bounds(1, MAX_MICROS, SIGNIFICANT_DIGITS)
            .expect("constant histogram bounds are valid");
        Self { micros }
    }

    /// Records one latency.
    pub fn record(&mut self, latency: Duration) {
        self.record_micros(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
    }

    /// Records one latency given in microseconds.
    pub fn record_micros(&mut self, micros: u64) {
        self.micros.saturating_record(micros);
    }

    /// Adds every value recorded in `other`.
    pub fn merge(&mut self, other: &Self) {
        self.micros
            .add(&other.micros)
            .expect("histograms with the same bounds always add");
    }

    /// The number of values recorded.
    pub fn count(&self) -> u64 {
        self.micros.len()
    }

    /// The percentile summary, or `None` when nothing was recorded.
    pub fn summary(&self) -> Option<Percentiles> {
        if self.micros.is_empty() {
            return None;
        }
        let ms = |micros: u64| micros as f64 / 1000.0;
        Some(Percentiles {
            count: self.micros.len(),
            mean: self.micros.mean() / 1000.0,
            p50: ms(self.micros.value_at_quantile(0.50)),
            p90: ms(self.micros.value_at_quantile(0.90)),
            p99: ms(self.micros.value_at_quantile(0.99)),
            max: ms(self.micros.max()),
        })
    }

    /// The distribution as `[quantile, ms]` points (every percent, then 99.5 % and 99.9 %),
    /// sorted by quantile, for plotting a CDF; empty when nothing was recorded.
    pub fn cdf(&self) -> Vec<[f64; 2]> {
        if self.micros.is_empty() {
            return Vec::new();
        }
        let mut points: Vec<[f64; 2]> = cdf_quantiles()
            .map(|q| [q, self.micros.value_at_quantile(q) as f64 / 1000.0])
            .collect();
        points.sort_by(|a, b| a[0].total_cmp(&b[0]));
        points
    }
}

/// Quantiles at which [`LatencyHistogram::cdf`] samples a distribution: every percent, then
/// the tail at 99.5 % and 99.9 %.
fn cdf_quantiles() -> impl Iterator<Item = f64> {
    (0..=100)
        .map(|p| f64::from(p) / 100.0)
        .chain([0.995, 0.999])
}

/// Percentiles of a latency distribution, in milliseconds (µs resolution).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Percentiles {
    /// Number of values.
    pub count: u64,
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_has_no_summary() {
        assert_eq!(LatencyHistogram::new().summary(), None);
    }

    #[test]
    fn percentiles_of_a_uniform_range() {
        let mut h = LatencyHistogram::new();
        for us in 1..=1000 {
            h.record_micros(us);
        }
        let s = h.summary().expect("values were recorded");
        assert_eq!(s.count, 1000);
        assert_eq!(s.p50, 0.5);
        assert_eq!(s.p90, 0.9);
        assert_eq!(s.p99, 0.99);
        assert_eq!(s.max, 1.0);
        assert!((s.mean - 0.5005).abs() < 1e-3);
    }

    #[test]
    fn a_single_outlier_shows_only_in_the_tail() {
        let mut h = LatencyHistogram::new();
        for _ in 0..999 {
            h.record(Duration::from_micros(200));
        }
        h.record(Duration::from_millis(50));
        let s = h.summary().expect("values were recorded");
        assert_eq!(s.p50, 0.2);
        assert_eq!(s.p99, 0.2);
        assert!((s.max - 50.0).abs() / 50.0 < 1e-3);
    }

    #[test]
    fn large_values_keep_three_significant_digits() {
        let mut h = LatencyHistogram::new();
        h.record(Duration::from_micros(1_234_567));
        let s = h.summary().expect("values were recorded");
        assert!((s.p50 - 1234.567).abs() / 1234.567 < 1e-3, "{}", s.p50);
    }

    #[test]
    fn zero_and_huge_values_are_kept() {
        let mut h = LatencyHistogram::new();
        h.record(Duration::ZERO);
        h.record(Duration::from_secs(10 * 3600));
        let s = h.summary().expect("values were recorded");
        assert_eq!(s.count, 2);
        assert_eq!(s.p50, 0.0);
        assert!(s.max >= 3_600_000.0 * 0.999);
    }

    #[test]
    fn cdf_points_rise_with_the_quantile() {
        assert!(LatencyHistogram::new().cdf().is_empty());
        let mut h = LatencyHistogram::new();
        for us in 1..=1000 {
            h.record_micros(us);
        }
        let cdf = h.cdf();
        assert_eq!(cdf.len(), 103);
        assert!(
            cdf.windows(2)
                .all(|w| w[0][0] <= w[1][0] && w[0][1] <= w[1][1])
        );
        assert_eq!(cdf[50], [0.5, 0.5]);
        assert_eq!(cdf.last().copied(), Some([1.0, 1.0]));
    }

    #[test]
    fn merging_adds_distributions() {
        let mut a = LatencyHistogram::new();
        let mut b = LatencyHistogram::new();
        for _ in 0..50 {
            a.record_micros(100);
            b.record_micros(300);
        }
        a.merge(&b);
        let s = a.summary().expect("values were recorded");
        assert_eq!(s.count, 100);
        assert_eq!(s.p50, 0.1);
        assert_eq!(s.p90, 0.3);
        assert_eq!(s.mean, 0.2);
    }
}

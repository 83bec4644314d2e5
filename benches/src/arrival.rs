//! Open-loop arrival schedules: Poisson arrivals from a seeded generator.
//!
//! A trace-driven schedule (request timestamps from a trace file) would sit beside this one and
//! hand the open-loop driver the same thing: the gap until the next arrival.

use std::time::Duration;

use crate::rng::SplitMix64;

/// Poisson arrivals at a fixed mean rate: exponentially distributed gaps, reproducible per seed.
#[derive(Debug, Clone)]
pub struct PoissonArrivals {
    mean_gap_s: f64,
    rng: SplitMix64,
}

impl PoissonArrivals {
    /// Arrivals at `rate_per_s` requests per second on average (must be positive and finite).
    pub fn new(rate_per_s: f64, seed: u64) -> Self {
        Self {
            mean_gap_s: 1.0 / rate_per_s,
            rng: SplitMix64::new(seed),
        }
    }

    /// The gap between the previous arrival and the next one.
    pub fn next_gap(&mut self) -> Duration {
        // 1 - u lies in (0, 1], so the logarithm is finite.
        let u = 1.0 - self.rng.next_unit();
        Duration::from_secs_f64(-u.ln() * self.mean_gap_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_gives_the_same_gaps() {
        let mut a = PoissonArrivals::new(1000.0, 11);
        let mut b = PoissonArrivals::new(1000.0, 11);
        let ga: Vec<Duration> = (0..1000).map(|_| a.next_gap()).collect();
        let gb: Vec<Duration> = (0..1000).map(|_| b.next_gap()).collect();
        assert_eq!(ga, gb);
    }

    #[test]
    fn another_seed_gives_other_gaps() {
        let mut a = PoissonArrivals::new(1000.0, 11);
        let mut b = PoissonArrivals::new(1000.0, 12);
        let differ = (0..100).filter(|_| a.next_gap() != b.next_gap()).count();
        assert!(differ > 90);
    }

    #[test]
    fn gaps_are_exponential_with_the_requested_mean() {
        let rate = 250.0;
        let mut arrivals = PoissonArrivals::new(rate, 5);
        let n = 200_000;
        let gaps: Vec<f64> = (0..n).map(|_| arrivals.next_gap().as_secs_f64()).collect();
        let mean = gaps.iter().sum::<f64>() / n as f64;
        assert!((mean * rate - 1.0).abs() < 0.02, "mean gap {mean}");
        // For an exponential law, P(gap > mean) = e^-1.
        let above = gaps.iter().filter(|g| **g > 1.0 / rate).count() as f64 / n as f64;
        assert!((above - (-1.0f64).exp()).abs() < 0.01, "tail {above}");
    }
}

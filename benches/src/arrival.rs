//! Open-loop arrival schedules: Poisson arrivals from a seeded generator, or fixed offsets from
//! a trace or a precomputed workload.

use std::sync::Arc;
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

/// When the requests of an open-loop run arrive.
#[derive(Debug, Clone)]
pub enum ArrivalPlan {
    /// Poisson arrivals, endless.
    Poisson {
        /// Mean requests per second.
        rate: f64,
        /// Seed of the gaps.
        seed: u64,
    },
    /// Request `i` arrives `offsets[i]` after the start (non-decreasing); the plan ends after
    /// the last one.
    Offsets(Arc<[Duration]>),
}

impl ArrivalPlan {
    /// The arrival times from the start, in order (`None` past the end of a finite plan).
    pub fn times(&self) -> impl Iterator<Item = Duration> + Send + use<> {
        let (mut poisson, offsets) = match self {
            Self::Poisson { rate, seed } => (Some(PoissonArrivals::new(*rate, *seed)), None),
            Self::Offsets(offsets) => (None, Some(offsets.clone())),
        };
        let mut now = Duration::ZERO;
        let mut index = 0;
        std::iter::from_fn(move || match (&mut poisson, &offsets) {
            (Some(gaps), _) => {
                now += gaps.next_gap();
                Some(now)
            }
            (None, Some(offsets)) => {
                let at = offsets.get(index).copied();
                index += 1;
                at
            }
            (None, None) => None,
        })
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
    fn plans_yield_cumulative_times() {
        let offsets: Arc<[Duration]> = [0, 0, 5].map(Duration::from_millis).into();
        let times: Vec<Duration> = ArrivalPlan::Offsets(offsets.clone()).times().collect();
        assert_eq!(times, offsets.to_vec());
        let mut gaps = PoissonArrivals::new(100.0, 3);
        let mut expected = Duration::ZERO;
        let poisson = ArrivalPlan::Poisson {
            rate: 100.0,
            seed: 3,
        };
        for t in poisson.times().take(50) {
            expected += gaps.next_gap();
            assert_eq!(t, expected);
        }
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

//! Choosing one candidate from their costs.
//!
//! - **Temperature 0**: the cheapest. Ties (costs within [`TIE_EPSILON`]) go to the candidate
//!   with the fewest requests in flight, then uniformly at random. Dynamo breaks ties towards
//!   the instance with the *fewest cached blocks* (kv-routing §10.7), which sends traffic to
//!   cold instances for no gain; in-flight requests are a real, current load signal.
//! - **Temperature T > 0**: a draw with `p(i) ∝ exp(−((cost(i) − min) / (max − min)) / T)`;
//!   all costs equal → uniform. Normalising by the range makes T independent of the cost scale.
//!
//! The random source is passed in: a thread-local RNG on the request path, a seeded one in tests.

use rand::Rng;

/// Costs closer than this are a tie.
pub(crate) const TIE_EPSILON: f64 = 1e-9;

/// One candidate as selection sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Scored {
    /// Its cost (lower is better).
    pub(crate) cost: f64,
    /// Requests in flight on it (the tie-break).
    pub(crate) in_flight: u64,
}

/// The probability of each candidate being chosen at `temperature` (sums to 1; empty for no
/// candidates).
pub(crate) fn probabilities(candidates: &[Scored], temperature: f64) -> Vec<f64> {
    if candidates.is_empty() {
        return Vec::new();
    }
    let min = candidates
        .iter()
        .map(|c| c.cost)
        .fold(f64::INFINITY, f64::min);
    let max = candidates
        .iter()
        .map(|c| c.cost)
        .fold(f64::NEG_INFINITY, f64::max);
    let uniform = 1.0 / candidates.len() as f64;
    if temperature <= 0.0 {
        let best = |c: &Scored| c.cost - min <= TIE_EPSILON;
        let fewest = candidates
            .iter()
            .filter(|c| best(c))
            .map(|c| c.in_flight)
            .min()
            .unwrap_or(0);
        let winner = |c: &Scored| best(c) && c.in_flight == fewest;
        let winners = candidates.iter().filter(|c| winner(c)).count().max(1);
        return candidates
            .iter()
            .map(|c| if winner(c) { 1.0 / winners as f64 } else { 0.0 })
            .collect();
    }
    let range = max - min;
    if !(range > TIE_EPSILON && range.is_finite()) {
        return vec![uniform; candidates.len()];
    }
    let weights: Vec<f64> = candidates
        .iter()
        .map(|c| (-((c.cost - min) / range) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Index of the chosen candidate (`None` when there are none).
pub(crate) fn select(candidates: &[Scored], temperature: f64, rng: &mut impl Rng) -> Option<usize> {
    let probabilities = probabilities(candidates, temperature);
    let last = probabilities.iter().rposition(|&p| p > 0.0)?;
    let mut draw: f64 = rng.r#gen::<f64>();
    for (i, &p) in probabilities.iter().enumerate() {
        if p > 0.0 && draw < p {
            return Some(i);
        }
        draw -= p;
    }
    // Rounding left the draw past the last bucket.
    Some(last)
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn scored(costs: &[(f64, u64)]) -> Vec<Scored> {
        costs
            .iter()
            .map(|&(cost, in_flight)| Scored { cost, in_flight })
            .collect()
    }

    fn histogram(candidates: &[Scored], temperature: f64, rounds: usize, seed: u64) -> Vec<usize> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut counts = vec![0; candidates.len()];
        for _ in 0..rounds {
            counts[select(candidates, temperature, &mut rng).unwrap()] += 1;
        }
        counts
    }

    #[test]
    fn zero_temperature_takes_the_cheapest() {
        let set = scored(&[(12.0, 0), (10.0, 5), (11.0, 0)]);
        assert_eq!(histogram(&set, 0.0, 50, 1), [0, 50, 0]);
        assert_eq!(probabilities(&set, 0.0), [0.0, 1.0, 0.0]);
    }

    #[test]
    fn ties_go_to_fewer_in_flight_requests_then_random() {
        let set = scored(&[(10.0, 3), (10.0, 1), (10.0 + 1e-12, 1), (9.0 + 1.0, 2)]);
        assert_eq!(probabilities(&set, 0.0), [0.0, 0.5, 0.5, 0.0]);
        let counts = histogram(&set, 0.0, 2000, 7);
        assert_eq!(counts[0] + counts[3], 0);
        assert!(counts[1] > 850 && counts[2] > 850, "{counts:?}");
        // Not the least-cached instance: cache size plays no part at all.
        let single = scored(&[(5.0, 0)]);
        assert_eq!(histogram(&single, 0.0, 10, 3), [10]);
    }

    #[test]
    fn seeded_draws_are_reproducible() {
        let set = scored(&[(1.0, 0), (1.0, 0), (1.0, 0), (1.0, 0)]);
        assert_eq!(histogram(&set, 0.0, 100, 42), histogram(&set, 0.0, 100, 42));
        assert_eq!(histogram(&set, 0.7, 100, 42), histogram(&set, 0.7, 100, 42));
    }

    #[test]
    fn softmax_follows_range_normalised_costs() {
        let set = scored(&[(0.0, 0), (50.0, 0), (100.0, 0)]);
        let p = probabilities(&set, 1.0);
        let e = std::f64::consts::E;
        let total = 1.0 + e.powf(-0.5) + e.powf(-1.0);
        for (got, want) in p
            .iter()
            .zip([1.0 / total, e.powf(-0.5) / total, e.powf(-1.0) / total])
        {
            assert!((got - want).abs() < 1e-12, "{p:?}");
        }
        // Scaling every cost leaves the probabilities unchanged.
        let scaled = scored(&[(0.0, 0), (5000.0, 0), (10000.0, 0)]);
        assert_eq!(probabilities(&scaled, 1.0), p);
        let counts = histogram(&set, 1.0, 20_000, 9);
        for (count, want) in counts.iter().zip(&p) {
            let share = *count as f64 / 20_000.0;
            assert!((share - want).abs() < 0.02, "{counts:?} vs {p:?}");
        }
    }

    #[test]
    fn temperature_flattens_and_sharpens() {
        let set = scored(&[(0.0, 0), (100.0, 0)]);
        let cold = probabilities(&set, 0.05);
        let hot = probabilities(&set, 100.0);
        assert!(cold[0] > 0.999, "{cold:?}");
        assert!((hot[0] - 0.5).abs() < 0.01, "{hot:?}");
        let equal = scored(&[(3.0, 9), (3.0, 0)]);
        assert_eq!(probabilities(&equal, 0.5), [0.5, 0.5]);
    }

    #[test]
    fn no_candidates_no_choice() {
        let mut rng = StdRng::seed_from_u64(0);
        assert_eq!(select(&[], 0.0, &mut rng), None);
        assert!(probabilities(&[], 1.0).is_empty());
    }
}

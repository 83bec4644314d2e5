//! How much more (above 1) or less a model's engines spend per prefilled token, against an
//! iteration's fixed part, than the cost model's profile says: the token factor, learned
//! from first-token times.
//!
//! The learned speed ([`crate::kv::speed`]) is one factor on the whole profile. An engine
//! whose time splits otherwise between an iteration's fixed part and its per-token part is
//! then mispredicted by prompt size, and a cached token is valued wrongly against everything
//! else the cost weighs. A real vLLM on CPU takes about 5.6 ms + 0.052 ms per token to a
//! first token; the profile (an H100's 16.5 ms + 0.0152 ms per token), scaled by the speed
//! learned for it (about 1.5), says 24.8 ms + 0.023 ms: a cached token worth 2.3× less than
//! it is.
//!
//! Each streamed request's first token is one sample: the time the profile predicted, split
//! into its fixed part `F` (iterations' fixed time, what running streams add, a KV pull) and
//! its token part `T` (per-token and quadratic terms, at factor 1), and the time observed,
//! `y`. The engines take `a·F + b·T` exactly when the ratio `r = y / (F + T)` is the straight
//! line `a + (b − a)·x` in the token share `x = T / (F + T)`; the line is fitted by weighted
//! least squares over a moving window of samples, and the factor is `b / a`. The speed then
//! learns what is left, the engine's scale.
//!
//! The factor is scored with its logarithm shrunk toward 0 by the evidence the samples give
//! about the line's slope: their weighted spread in token share, `E = Σ w·(x − x̄)²`, against
//! [`PRIOR_EVIDENCE`]. A fleet whose prompts all cost alike (no spread in `x`) keeps the
//! profile's shape; one with prompts from tens to thousands of uncached tokens learns its
//! shape within about a hundred first tokens. First-token times are late far more often
//! than early, and sometimes very late (a real vLLM on CPU, idle, took 184 to 398 ms for some
//! 150-token prompts whose median was 25 ms: the machine's other work, the engine's
//! scheduler), so a sample counts at most 1.25× above the line's prediction at its `x` and
//! 2× below it; while the line's slope is not yet known, 1.5× above the mean ratio and 3×
//! below (the first two samples, alike in size, can draw any line). Clipped
//! symmetrically (1.5× either way), 36 first tokens of a real vLLM gave factors from 0.34 to
//! 3.4 where the engine's own line says about 1.5.
//!
//! Only first tokens of requests that had their instance to themselves (of this proxy's
//! requests) from booking to first token teach it. Behind other requests, or batched with
//! requests booked after it, a first token measures the load model's errors more than the
//! engine's shape: learned from first tokens booked behind others too (weighted as the
//! speed's samples are), the factor fell to 0.2 in one real-engine run and reuse with it
//! (0.66 of prompt tokens cached, against 0.71); learned from the first of each burst of
//! concurrent streams (booked alone, then batched with the burst), to 0.07.
//!
//! Proxy replicas share their sums ([`TokenCostSums`]); each scores with the sum of its own
//! and the others', so replicas learn one factor.

/// Weight of one sample in the moving window: the sums decay by this share per sample.
const LEARNING_RATE: f64 = 0.01;

/// The evidence (weighted spread of token shares) that counts as much as the profile's own
/// shape: about 16 samples spread as a chat's prompts are (token shares 0.05 to 0.5).
pub(crate) const PRIOR_EVIDENCE: f64 = 0.25;

/// The factor is bounded to this either way.
const MAX_FACTOR: f64 = 32.0;

/// A sample's ratio counts at most this many times the line's prediction (late: noise).
const MAX_ABOVE: f64 = 1.25;

/// A sample's ratio counts at least the line's prediction divided by this (early).
const MAX_BELOW: f64 = 2.0;

/// [`MAX_ABOVE`] around the mean ratio, while the line's slope is not yet known
/// ([`PRIOR_EVIDENCE`]).
const EARLY_ABOVE: f64 = 1.5;

/// [`MAX_BELOW`] around the mean ratio, while the line's slope is not yet known.
const EARLY_BELOW: f64 = 3.0;

/// Neither part of the line is taken for less than this share of the mean ratio (a noisy
/// fit can cross 0).
const MIN_PART: f64 = 0.05;

/// Weighted sums of first tokens' token shares and ratios: what the fit needs, and what
/// replicas share (sums add).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TokenCostSums {
    /// Σ w.
    pub weight: f64,
    /// Σ w·x (x: the token share of the profiled time).
    pub share: f64,
    /// Σ w·r (r: observed ÷ profiled time at factor 1).
    pub ratio: f64,
    /// Σ w·x².
    pub share_squared: f64,
    /// Σ w·x·r.
    pub share_ratio: f64,
}

impl TokenCostSums {
    /// Both together.
    pub fn merged(self, other: TokenCostSums) -> TokenCostSums {
        TokenCostSums {
            weight: self.weight + other.weight,
            share: self.share + other.share,
            ratio: self.ratio + other.ratio,
            share_squared: self.share_squared + other.share_squared,
            share_ratio: self.share_ratio + other.share_ratio,
        }
    }

    /// Whether every sum is a finite number and the weight not negative (a share from
    /// another replica may not be).
    pub fn is_valid(&self) -> bool {
        self.weight >= 0.0
            && [
                self.weight,
                self.share,
                self.ratio,
                self.share_squared,
                self.share_ratio,
            ]
            .iter()
            .all(|sum| sum.is_finite())
    }

    /// The fitted line `(a, b)`: the ratio at token share 0 and at 1; `None` without
    /// samples or without spread in token share.
    fn line(&self) -> Option<(f64, f64)> {
        if !self.is_valid() || self.weight <= 0.0 {
            return None;
        }
        let mean_share = self.share / self.weight;
        let mean_ratio = self.ratio / self.weight;
        let spread = self.share_squared / self.weight - mean_share * mean_share;
        if spread <= 1e-9 || mean_ratio <= 0.0 {
            return None;
        }
        let slope = (self.share_ratio / self.weight - mean_share * mean_ratio) / spread;
        let floor = MIN_PART * mean_ratio;
        let fixed = (mean_ratio - slope * mean_share).max(floor);
        let token = (fixed + slope).max(floor);
        Some((fixed, token))
    }

    /// The evidence about the line's slope: the samples' weighted spread in token share.
    fn evidence(&self) -> f64 {
        if !self.is_valid() || self.weight <= 0.0 {
            return 0.0;
        }
        let mean_share = self.share / self.weight;
        (self.share_squared - self.weight * mean_share * mean_share).max(0.0)
    }

    /// The token factor as scored (1: the profile's shape).
    pub(crate) fn factor(&self) -> f64 {
        let Some((fixed, token)) = self.line() else {
            return 1.0;
        };
        let evidence = self.evidence();
        let ln_factor = (token / fixed)
            .ln()
            .clamp(-MAX_FACTOR.ln(), MAX_FACTOR.ln());
        (ln_factor * evidence / (evidence + PRIOR_EVIDENCE)).exp()
    }

    /// Learns from one first token: the profile predicted `fixed_ms` plus `token_ms` (at
    /// factor 1), it took `observed_ms`. Nonsense (negative or not finite times, nothing
    /// predicted) is ignored.
    pub(crate) fn observe(&mut self, fixed_ms: f64, token_ms: f64, observed_ms: f64) {
        let profiled = fixed_ms + token_ms;
        if !(fixed_ms >= 0.0
            && token_ms >= 0.0
            && profiled > 0.0
            && observed_ms > 0.0
            && (profiled * observed_ms).is_finite())
        {
            return;
        }
        let share = token_ms / profiled;
        let mut ratio = observed_ms / profiled;
        // Around the line once its slope is known; until then around the mean ratio, as far
        // as the line may yet lean either way (two samples alike in size make a wild line).
        let around = if self.evidence() >= PRIOR_EVIDENCE {
            self.line()
                .map(|(fixed, token)| (fixed + (token - fixed) * share, MAX_ABOVE, MAX_BELOW))
        } else {
            None
        };
        let around = around.or_else(|| {
            (self.weight > 0.0 && self.ratio > 0.0)
                .then(|| (self.ratio / self.weight, EARLY_ABOVE, EARLY_BELOW))
        });
        if let Some((predicted, above, below)) = around.filter(|(predicted, _, _)| *predicted > 0.0)
        {
            ratio = ratio.clamp(predicted / below, predicted * above);
        }
        let keep = 1.0 - LEARNING_RATE;
        *self = TokenCostSums {
            weight: keep * self.weight + 1.0,
            share: keep * self.share + share,
            ratio: keep * self.ratio + ratio,
            share_squared: keep * self.share_squared + share * share,
            share_ratio: keep * self.share_ratio + share * ratio,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform draws in [0, 1) from a fixed seed.
    fn uniform(seed: u64) -> impl FnMut() -> f64 {
        let mut state = seed;
        move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        }
    }

    /// The profile's split of one iteration prefilling `tokens` tokens: (fixed, token) ms.
    fn profiled(tokens: f64) -> (f64, f64) {
        (16.5, 0.0152 * tokens)
    }

    /// `n` first tokens of prompts of 60 to 1,000 uncached tokens on an engine taking
    /// `fixed + per_token × tokens` ms, each off by a factor spread ±`noise`.
    fn learned(n: usize, fixed: f64, per_token: f64, noise: f64, seed: u64) -> TokenCostSums {
        let mut draw = uniform(seed);
        let mut sums = TokenCostSums::default();
        for _ in 0..n {
            let tokens = 60.0 + 940.0 * draw();
            let observed = (fixed + per_token * tokens) * (1.0 + noise * (2.0 * draw() - 1.0));
            let (profiled_fixed, profiled_token) = profiled(tokens);
            sums.observe(profiled_fixed, profiled_token, observed);
        }
        sums
    }

    #[test]
    fn an_engine_shaped_as_profiled_keeps_the_factor_at_one() {
        for seed in 0..50 {
            // Twice as slow as profiled throughout: the speed's part, not the factor's.
            let factor = learned(200, 33.0, 0.0304, 0.2, seed).factor();
            assert!(factor > 0.75 && factor < 1.33, "seed {seed}: {factor}");
        }
    }

    #[test]
    fn a_cpu_engine_is_learned_to_spend_more_per_token() {
        // The real vLLM on CPU: 5.6 ms + 0.052 ms per token, against 16.5 + 0.0152:
        // b / a = (0.052 / 0.0152) / (5.6 / 16.5) = 10.1.
        for seed in 0..50 {
            let early = learned(32, 5.6, 0.052, 0.3, seed).factor();
            let later = learned(200, 5.6, 0.052, 0.3, seed).factor();
            assert!(early > 2.0, "seed {seed}: {early} after 32");
            assert!(
                later > 4.0 && later < 15.0,
                "seed {seed}: {later} after 200"
            );
        }
    }

    #[test]
    fn prompts_all_alike_teach_nothing() {
        let mut sums = TokenCostSums::default();
        for _ in 0..100 {
            sums.observe(16.5, 10.0, 40.0);
        }
        assert_eq!(sums.factor(), 1.0);
        assert_eq!(TokenCostSums::default().factor(), 1.0);
    }

    #[test]
    fn a_cold_first_request_is_clipped() {
        let steady = learned(100, 5.6, 0.052, 0.0, 7);
        let mut cold = steady;
        // A 20× outlier at a small prompt counts as 1.25× the line there.
        cold.observe(16.5, 1.0, 20.0 * (5.6 + 0.052 * 66.0));
        let (before, after) = (steady.factor(), cold.factor());
        assert!(after / before > 0.8, "{before} then {after}");
    }

    #[test]
    fn late_first_tokens_do_not_tip_the_factor() {
        // What the real-engine suite's engines take through a debug proxy: 44 ms plus
        // 0.063 ms a token (b / a = 1.55), each first token late by a half-normal 20 %, and
        // one in ten 2 to 8 times late.
        let mut near = 0;
        for seed in 0..100 {
            let mut draw = uniform(seed);
            let mut sums = TokenCostSums::default();
            for _ in 0..96 {
                let tokens = [22.0, 95.0, 300.0, 750.0, 1500.0, 2400.0][(draw() * 6.0) as usize];
                let normal =
                    (-2.0 * draw().ln()).sqrt() * (2.0 * std::f64::consts::PI * draw()).cos();
                let mut observed = (44.0 + 0.063 * tokens) * (1.0 + 0.2 * normal.abs());
                if draw() < 0.1 {
                    observed *= 2.0 + 6.0 * draw();
                }
                let (fixed, token) = profiled(tokens);
                sums.observe(fixed, token, observed);
            }
            let factor = sums.factor();
            assert!(
                factor > 0.9,
                "seed {seed}: {factor}, on the wrong side of 1"
            );
            near += usize::from(factor > 1.2 && factor < 2.0);
        }
        assert!(near >= 95, "{near} of 100 within 1.2 to 2");
    }

    #[test]
    fn replicas_sums_add_up_to_one_fit() {
        let a = learned(60, 5.6, 0.052, 0.1, 1);
        let b = learned(60, 5.6, 0.052, 0.1, 2);
        let both = a.merged(b);
        assert!((both.weight - (a.weight + b.weight)).abs() < 1e-9);
        // More evidence together than either alone: scored further from 1.
        assert!(both.factor() > a.factor().min(b.factor()));
    }

    #[test]
    fn nonsense_is_ignored() {
        let mut sums = TokenCostSums::default();
        for (fixed, token, observed) in [
            (0.0, 0.0, 5.0),
            (-1.0, 5.0, 5.0),
            (5.0, 5.0, 0.0),
            (f64::NAN, 1.0, 1.0),
            (1.0, 1.0, f64::INFINITY),
        ] {
            sums.observe(fixed, token, observed);
        }
        assert_eq!(sums, TokenCostSums::default());
        let bad = TokenCostSums {
            weight: f64::NAN,
            ..TokenCostSums::default()
        };
        assert!(!bad.is_valid());
        assert_eq!(bad.factor(), 1.0);
    }
}

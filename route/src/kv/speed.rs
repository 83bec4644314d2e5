//! How much slower (above 1) or faster than the cost model's engine profile one instance
//! proves to be, learned from the first-token times of its streamed requests.
//!
//! Each streamed request booked with a profiled time to first token (what the profile
//! predicts from the load the proxy knew at booking) gives one sample, observed ÷ profiled,
//! when its first token arrives. The factor is the mean of the samples' logarithms (a moving
//! average once there are `1 / LEARNING_RATE` of them), so a 2× slower and a 2× faster
//! sample cancel out; each sample's distance from the factor so far is clipped to
//! [`MAX_STEP`] either way, so one outlier (an engine's first, cold request) moves it by at
//! most that share of a doubling. Non-streamed responses teach nothing: their first byte
//! comes with their last token.
//!
//! An instance with few samples leans on the whole model's factor (every instance's samples
//! together, [`LearnedSpeed::shrunk_toward`]): a fleet that runs 4× faster than profiled is
//! learned from its first answers, and a new instance is not taken for 4× slower than its
//! peers until it has been tried (which would starve it of the requests that teach it).
//! Until an instance has [`PRIOR_SAMPLES`] samples of its own, the fleet's factor weighs more
//! than its own: first-token times through a real engine's HTTP server are noisy (a real vLLM
//! on CPU gave two identical engines factors of 7.6 and 12.1 from their first few samples
//! each), and an idle pair of identical engines whose factors differ by that much draws a
//! whole burst onto one of them. A truly slower instance still shows: 3× slower (samples
//! spread ±20 %), it is scored at least 1.4× slower after 16 samples, 1.7× after 32 and
//! 2.25× after 400 (tests below).
//!
//! A first token that waited behind other requests on the instance measures the load model's
//! errors as much as the instance's speed: a real vLLM on CPU serves a burst's requests one
//! after another through its API server, so the fourth of four took about four times the
//! first's time while the profile predicted nearly the same for both, and whichever of two
//! identical engines had drawn more of a burst learned itself slower, by 1.3× after five
//! bursts of eight, which made it draw 1 of the next 8 streams. So each sample weighs
//! `1 / (1 + requests in flight there at booking)`: a request booked on an idle instance
//! counts whole, the fourth of a burst a quarter.
//!
//! An instance is told apart from its fleet only by what its samples prove: the distance
//! between its factor and the fleet's counts less two standard errors of its samples' mean
//! (their spread, learned beside the factor, over the weight of samples). Two identical
//! engines whose first bursts happened to take 1.5× apart (a real vLLM on CPU, the first
//! burst after start) are scored alike, while one whose samples keep saying it is 3× slower
//! is told apart within a few of them. On a machine where first-token times spread widely
//! the margin is wide; where they do not, narrow.
//!
//! Proxy replicas share their factors ([`SharedSpeed`]); each scores with its own merged with
//! the others', weighted by samples, so that replicas predict the same times.

use crate::kv::replicas::SharedSpeed;

/// Weight of one sample in the moving average.
pub(crate) const LEARNING_RATE: f64 = 0.05;

/// Samples are clamped to this factor either way (a request stuck behind a stall, or a
/// profile far off, must not swing the estimate past recovery).
const MAX_SAMPLE: f64 = 100.0;

/// How many samples an instance needs before its own factor weighs as much as the model's.
pub(crate) const PRIOR_SAMPLES: f64 = 16.0;

/// A sample's logarithm counts at most this far from the factor learned so far (ln 2).
const MAX_STEP: f64 = std::f64::consts::LN_2;

/// The variance of samples' logarithms assumed before any are seen (a spread of ±65 %,
/// σ = 0.5), weighing as [`PRIOR_VARIANCE_SAMPLES`] samples: two samples that happen to
/// agree do not prove an instance's factor to the last per cent.
const PRIOR_LN_VARIANCE: f64 = 0.25;

/// How many samples the assumed variance weighs as.
const PRIOR_VARIANCE_SAMPLES: f64 = 2.0;

/// Standard errors the distance from the fleet's factor must exceed to count at all.
const MARGIN_STANDARD_ERRORS: f64 = 2.0;

/// The moving average's effective sample count ((2 − rate) / rate): its mean is no surer
/// than this many samples make it, however many it has seen.
const WINDOW_SAMPLES: f64 = (2.0 - LEARNING_RATE) / LEARNING_RATE;

/// One instance's (or one model's) learned speed factor.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct LearnedSpeed {
    ln_factor: f64,
    /// The (weighted, moving) variance of the samples' logarithms around it.
    ln_variance: f64,
    /// Samples learned from (what replicas share).
    samples: u64,
    /// Their weights summed (each at most 1).
    weight: f64,
}

impl LearnedSpeed {
    /// The factor as scored: its logarithm's distance from `prior`'s (the fleet's) less
    /// [`MARGIN_STANDARD_ERRORS`] standard errors of its samples' mean, then pulled toward
    /// `prior` as if `prior` were [`PRIOR_SAMPLES`] samples: the prior alone before any
    /// sample of its own, its own factor once it has many that agree.
    pub(crate) fn shrunk_toward(&self, prior_ln_factor: f64) -> f64 {
        let own = self.weight;
        if own <= 0.0 {
            return prior_ln_factor.exp();
        }
        let variance = (own * self.ln_variance + PRIOR_VARIANCE_SAMPLES * PRIOR_LN_VARIANCE)
            / (own + PRIOR_VARIANCE_SAMPLES);
        let margin = MARGIN_STANDARD_ERRORS * (variance / own.min(WINDOW_SAMPLES)).sqrt();
        let distance = self.ln_factor - prior_ln_factor;
        let proven = distance.signum() * (distance.abs() - margin).max(0.0);
        (prior_ln_factor + own / (own + PRIOR_SAMPLES) * proven).exp()
    }

    /// The factor's natural logarithm.
    pub(crate) fn ln_factor(&self) -> f64 {
        self.ln_factor
    }

    /// This speed as replicas share it.
    pub(crate) fn shared(&self) -> SharedSpeed {
        SharedSpeed {
            ln_factor: self.ln_factor,
            ln_variance: self.ln_variance,
            samples: self.samples,
        }
    }

    /// This speed with `others`' samples (the other replicas') merged in.
    pub(crate) fn with(&self, others: SharedSpeed) -> LearnedSpeed {
        let merged = self.shared().merged(others);
        LearnedSpeed {
            ln_factor: merged.ln_factor,
            ln_variance: merged.ln_variance,
            samples: merged.samples,
            weight: self.weight + others.samples as f64,
        }
    }

    /// Learns from one request: the profile predicted `profiled_ms` to its first token, it
    /// took `observed_ms`; the sample weighs `weight` (0 to 1: `1 / (1 + requests ahead)`).
    /// A first sample is clipped around `prior_ln_factor` when there is one (an instance's
    /// first request is often its engine's slowest: a real vLLM's first took 20× its later
    /// ones, and taken whole it marked one of two identical engines 1.4× slower than the
    /// other). Nonsense (zero, negative, not finite) is ignored.
    pub(crate) fn observe(
        &mut self,
        profiled_ms: f64,
        observed_ms: f64,
        weight: f64,
        prior_ln_factor: Option<f64>,
    ) {
        if !(profiled_ms > 0.0 && observed_ms > 0.0 && (profiled_ms * observed_ms).is_finite()) {
            return;
        }
        let weight = if weight.is_finite() {
            weight.clamp(0.0, 1.0)
        } else {
            0.0
        };
        if weight == 0.0 {
            return;
        }
        let sample = (observed_ms / profiled_ms).clamp(1.0 / MAX_SAMPLE, MAX_SAMPLE);
        // The first sample counts whole (a fleet 4× faster than profiled is learned at once);
        // later ones as in a weighted mean until the moving average's window is full.
        if self.weight == 0.0 {
            self.ln_factor = match prior_ln_factor {
                Some(prior) => prior + (sample.ln() - prior).clamp(-MAX_STEP, MAX_STEP),
                None => sample.ln(),
            };
        } else {
            let step = (sample.ln() - self.ln_factor).clamp(-MAX_STEP, MAX_STEP);
            let rate = (weight / (self.weight + weight)).max(LEARNING_RATE * weight);
            self.ln_factor += rate * step;
            self.ln_variance = (1.0 - rate) * (self.ln_variance + rate * step * step);
        }
        self.weight += weight;
        self.samples += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn starts_at_the_profile_and_takes_the_first_sample_whole() {
        let mut speed = LearnedSpeed::default();
        assert_eq!(
            (speed.shrunk_toward(speed.ln_factor), speed.samples),
            (1.0, 0)
        );
        speed.observe(100.0, 25.0, 1.0, None);
        assert!(close(speed.shrunk_toward(speed.ln_factor), 0.25));
        assert_eq!(speed.samples, 1);
    }

    #[test]
    fn later_samples_average_and_outliers_are_bounded() {
        let mut speed = LearnedSpeed::default();
        speed.observe(10.0, 10.0, 1.0, None);
        speed.observe(10.0, 20.0, 1.0, None);
        // The mean of ln 1 and ln 2.
        assert!(close(speed.shrunk_toward(speed.ln_factor), 2f64.sqrt()));
        let mut stuck = LearnedSpeed::default();
        stuck.observe(10.0, 10.0, 1.0, None);
        stuck.observe(1.0, 1e9, 1.0, None);
        // A 100× sample counts as a 2× one.
        assert!(close(stuck.shrunk_toward(stuck.ln_factor), 2f64.sqrt()));
        // Converges on a steady ratio.
        for _ in 0..600 {
            speed.observe(40.0, 120.0, 1.0, None);
        }
        assert!((speed.shrunk_toward(speed.ln_factor) - 3.0).abs() < 1e-6);
    }

    #[test]
    fn few_samples_lean_on_the_prior_and_many_on_their_own() {
        let mut speed = LearnedSpeed::default();
        let prior = 0.25f64.ln();
        assert!(close(speed.shrunk_toward(prior), 0.25));
        speed.observe(10.0, 10.0, 1.0, None);
        // One sample of factor 1, 4× the prior: its distance (ln 4) less two standard errors
        // of one sample under the assumed spread (variance (0 + 2 × 0.25) / 3), against
        // sixteen samples of the prior.
        let margin = 2.0 * (0.5f64 / 3.0).sqrt();
        let expected = 0.25 * ((4f64.ln() - margin) / 17.0).exp();
        assert!(close(speed.shrunk_toward(prior), expected));
        for _ in 0..2000 {
            speed.observe(10.0, 10.0, 1.0, None);
        }
        assert!((speed.shrunk_toward(prior) - 1.0).abs() < 0.02);
    }

    /// Samples `factor × e^N(0, sigma)`, from a fixed seed.
    fn noisy(seed: u64, factor: f64, sigma: f64) -> impl FnMut() -> f64 {
        let mut state = seed;
        let mut uniform = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        move || {
            let normal =
                (-2.0 * uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * uniform()).cos();
            factor * (sigma * normal).exp()
        }
    }

    /// Two instances and their fleet after `n` samples each, with `noise` the spread of one
    /// sample (a lognormal's sigma): each instance's scored factor.
    fn learned_pair(n: usize, slow: f64, noise: f64, seed: u64) -> (f64, f64) {
        let (mut fast, mut slower, mut fleet) = Default::default();
        let mut fast_samples = noisy(seed, 10.0, noise);
        let mut slow_samples = noisy(seed ^ 0x9e37_79b9, 10.0 * slow, noise);
        for _ in 0..n {
            for (own, sample) in [(&mut fast, fast_samples()), (&mut slower, slow_samples())] {
                LearnedSpeed::observe(&mut fleet, 10.0, 10.0 * sample, 1.0, None);
                LearnedSpeed::observe(own, 10.0, 10.0 * sample, 1.0, Some(fleet.ln_factor));
            }
        }
        let fleet: LearnedSpeed = fleet;
        let scored = |own: &LearnedSpeed| own.shrunk_toward(fleet.ln_factor);
        (scored(&fast), scored(&slower))
    }

    #[test]
    fn identical_instances_agree_despite_noisy_first_samples() {
        // First-token samples through a real engine spread this much (its HTTP server and
        // scheduler): 7.6 and 12.1 were learned for two identical engines.
        for seed in 0..200 {
            for n in [1, 2, 4, 8, 16, 32] {
                let (a, b) = learned_pair(n, 1.0, 0.4, seed);
                let ratio = a.max(b) / a.min(b);
                assert!(ratio < 1.1, "seed {seed}, {n} samples each: {a} vs {b}");
            }
        }
    }

    #[test]
    fn samples_that_waited_behind_others_weigh_less() {
        // Bursts served one request after another: the k-th of a burst on an instance waits
        // for the k - 1 before it, k times the first's time, booked with k - 1 ahead. Two
        // identical instances draw 6 and 2 of each burst of 8, four bursts.
        let (mut busy, mut quiet, mut fleet) = (
            LearnedSpeed::default(),
            LearnedSpeed::default(),
            LearnedSpeed::default(),
        );
        for _ in 0..4 {
            for (own, drawn) in [(&mut busy, 6), (&mut quiet, 2)] {
                for k in 1..=drawn {
                    let weight = 1.0 / f64::from(k);
                    fleet.observe(10.0, 100.0 * f64::from(k), weight, None);
                    own.observe(10.0, 100.0 * f64::from(k), weight, Some(fleet.ln_factor));
                }
            }
        }
        let (busy, quiet) = (
            busy.shrunk_toward(fleet.ln_factor),
            quiet.shrunk_toward(fleet.ln_factor),
        );
        assert!(busy / quiet < 1.25, "{busy} vs {quiet}");
        // Counted whole, the busy one would have learned itself 1.6× slower.
        let (mut whole_busy, mut whole_quiet) = (LearnedSpeed::default(), LearnedSpeed::default());
        for _ in 0..4 {
            for (own, drawn) in [(&mut whole_busy, 6), (&mut whole_quiet, 2)] {
                for k in 1..=drawn {
                    own.observe(10.0, 100.0 * f64::from(k), 1.0, None);
                }
            }
        }
        let unweighted = whole_busy.shrunk_toward(whole_busy.ln_factor)
            / whole_quiet.shrunk_toward(whole_quiet.ln_factor);
        assert!(unweighted > 1.5, "{unweighted}");
    }

    #[test]
    fn a_cold_first_request_is_clipped_around_the_fleet() {
        let mut fleet = LearnedSpeed::default();
        fleet.observe(10.0, 50.0, 1.0, None);
        // A new instance's first request takes 20× the fleet's.
        let mut new = LearnedSpeed::default();
        new.observe(10.0, 1000.0, 1.0, Some(fleet.ln_factor));
        assert!(close(new.ln_factor, 5f64.ln() + std::f64::consts::LN_2));
        // Without a fleet to go by, it counts whole.
        let mut alone = LearnedSpeed::default();
        alone.observe(10.0, 1000.0, 1.0, None);
        assert!(close(alone.ln_factor, 100f64.ln()));
    }

    #[test]
    fn a_slower_instance_still_shows() {
        for seed in 0..50 {
            let after = |n| {
                let (fast, slow) = learned_pair(n, 3.0, 0.2, seed);
                slow / fast
            };
            // Each side's distance from the fleet loses two standard errors of its mean.
            assert!(after(16) > 1.4, "seed {seed}: {}", after(16));
            assert!(after(32) > 1.7, "seed {seed}: {}", after(32));
            assert!(after(400) > 2.25, "seed {seed}: {}", after(400));
        }
    }

    #[test]
    fn nonsense_is_ignored() {
        let mut speed = LearnedSpeed::default();
        for (profiled, observed) in [
            (0.0, 5.0),
            (5.0, 0.0),
            (-1.0, 5.0),
            (f64::NAN, 1.0),
            (1.0, f64::INFINITY),
        ] {
            speed.observe(profiled, observed, 1.0, None);
        }
        assert_eq!(speed, LearnedSpeed::default());
    }
}

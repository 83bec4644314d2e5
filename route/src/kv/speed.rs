//! How much slower (above 1) or faster than the cost model's engine profile one instance
//! proves to be, learned from the first-token times of its streamed requests.
//!
//! Each streamed request booked with a profiled time to first token (what the profile
//! predicts from the load the proxy knew at booking) gives one sample, observed ÷ profiled,
//! when its first token arrives. The factor is a moving average of the samples' logarithms,
//! so a 2× slower and a 2× faster sample cancel out and one outlier moves it by at most
//! [`LEARNING_RATE`] of its logarithm. Non-streamed responses teach nothing: their first
//! byte comes with their last token.
//!
//! An instance with few samples leans on the whole model's factor (every instance's samples
//! together, [`LearnedSpeed::shrunk_toward`]): a fleet that runs 4× faster than profiled is
//! learned from its first answers, and a new instance is not taken for 4× slower than its
//! peers until it has been tried (which would starve it of the requests that teach it).
//!
//! Proxy replicas share their factors ([`SharedSpeed`]); each scores with its own merged with
//! the others', weighted by samples, so that replicas predict the same times.

use crate::kv::replicas::SharedSpeed;

/// Weight of one sample in the moving average.
pub(crate) const LEARNING_RATE: f64 = 0.1;

/// Samples are clamped to this factor either way (a request stuck behind a stall, or a
/// profile far off, must not swing the estimate past recovery).
const MAX_SAMPLE: f64 = 100.0;

/// How many samples an instance needs before its own factor weighs as much as the model's.
const PRIOR_SAMPLES: f64 = 4.0;

/// One instance's (or one model's) learned speed factor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LearnedSpeed {
    ln_factor: f64,
    samples: u64,
}

impl Default for LearnedSpeed {
    fn default() -> Self {
        Self {
            ln_factor: 0.0,
            samples: 0,
        }
    }
}

impl LearnedSpeed {
    /// The factor, its logarithm pulled toward `prior`'s as if `prior` were
    /// [`PRIOR_SAMPLES`] samples: the prior alone before any sample of its own, its own
    /// factor once it has many.
    pub(crate) fn shrunk_toward(&self, prior_ln_factor: f64) -> f64 {
        let own = self.samples as f64;
        ((own * self.ln_factor + PRIOR_SAMPLES * prior_ln_factor) / (own + PRIOR_SAMPLES)).exp()
    }

    /// The factor's natural logarithm.
    pub(crate) fn ln_factor(&self) -> f64 {
        self.ln_factor
    }

    /// This speed as replicas share it.
    pub(crate) fn shared(&self) -> SharedSpeed {
        SharedSpeed {
            ln_factor: self.ln_factor,
            samples: self.samples,
        }
    }

    /// This speed with `others`' samples (the other replicas') merged in.
    pub(crate) fn with(&self, others: SharedSpeed) -> LearnedSpeed {
        let merged = self.shared().merged(others);
        LearnedSpeed {
            ln_factor: merged.ln_factor,
            samples: merged.samples,
        }
    }

    /// Learns from one request: the profile predicted `profiled_ms` to its first token, it
    /// took `observed_ms`. Nonsense (zero, negative, not finite) is ignored.
    pub(crate) fn observe(&mut self, profiled_ms: f64, observed_ms: f64) {
        if !(profiled_ms > 0.0 && observed_ms > 0.0 && (profiled_ms * observed_ms).is_finite()) {
            return;
        }
        let sample = (observed_ms / profiled_ms).clamp(1.0 / MAX_SAMPLE, MAX_SAMPLE);
        // The first sample counts whole: a fleet 4× faster than profiled is learned at once.
        let rate = if self.samples == 0 {
            1.0
        } else {
            LEARNING_RATE
        };
        self.ln_factor += rate * (sample.ln() - self.ln_factor);
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
        speed.observe(100.0, 25.0);
        assert!(close(speed.shrunk_toward(speed.ln_factor), 0.25));
        assert_eq!(speed.samples, 1);
    }

    #[test]
    fn later_samples_move_it_geometrically_and_outliers_are_bounded() {
        let mut speed = LearnedSpeed::default();
        speed.observe(10.0, 10.0);
        speed.observe(10.0, 20.0);
        assert!(close(
            speed.shrunk_toward(speed.ln_factor),
            2f64.powf(LEARNING_RATE)
        ));
        let mut stuck = LearnedSpeed::default();
        stuck.observe(10.0, 10.0);
        stuck.observe(1.0, 1e9);
        assert!(close(
            stuck.shrunk_toward(stuck.ln_factor),
            MAX_SAMPLE.powf(LEARNING_RATE)
        ));
        // Converges on a steady ratio.
        for _ in 0..200 {
            speed.observe(40.0, 120.0);
        }
        assert!((speed.shrunk_toward(speed.ln_factor) - 3.0).abs() < 1e-6);
    }

    #[test]
    fn few_samples_lean_on_the_prior_and_many_on_their_own() {
        let mut speed = LearnedSpeed::default();
        let prior = 0.25f64.ln();
        assert!(close(speed.shrunk_toward(prior), 0.25));
        speed.observe(10.0, 10.0);
        // One sample of factor 1 against four of 0.25: exp(4/5 × ln 0.25).
        assert!(close(speed.shrunk_toward(prior), 0.25f64.powf(0.8)));
        for _ in 0..400 {
            speed.observe(10.0, 10.0);
        }
        assert!((speed.shrunk_toward(prior) - 1.0).abs() < 0.02);
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
            speed.observe(profiled, observed);
        }
        assert_eq!(speed, LearnedSpeed::default());
    }
}

//! The iteration timing model (Dynamo mocker's polynomial perf model).
//!
//! ```text
//! prefill_ms(T) = (4.209989e-7·T² + 0.01518344·T + 16.50142) / speedup
//! decode_ms(u)  = max(1, −25.74·u² + 54.01·u + 5.74) / (speedup · decode_speedup)
//! ```
//! Edge rules: no prefill tokens in the batch → prefill 0; no running sequence → decode 0;
//! the 1 ms floor applies before the division; a ratio <= 0 means "no scaling".
//!
//! Tokens loaded from the host tier (`L` of them, with `P` prefilled) cost the `load_cost`
//! share of what prefilling them in the same batch would add:
//! `load_cost · (prefill_ms(P + L) − prefill_ms(P))`.

use std::time::Duration;

/// Longest iteration the model will ask for (guards against absurd speed-up ratios).
const MAX_ITERATION: Duration = Duration::from_secs(3600);

/// Timing knobs of one engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TimingModel {
    speedup: f64,
    decode_speedup: f64,
    load_cost: f64,
}

impl TimingModel {
    /// A model with the given speed-up ratios (values <= 0 mean 1) and host-tier load cost
    /// (a share of the prefill time, 0..=1).
    pub(crate) fn new(speedup_ratio: f64, decode_speedup_ratio: f64, load_cost: f64) -> Self {
        let scale = |r: f64| if r > 0.0 { r } else { 1.0 };
        Self {
            speedup: scale(speedup_ratio),
            decode_speedup: scale(decode_speedup_ratio),
            load_cost: load_cost.clamp(0.0, 1.0),
        }
    }

    /// Milliseconds to prefill `tokens` new tokens in one batch.
    pub(crate) fn prefill_ms(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        (4.209_989e-7 * t * t + 0.015_183_44 * t + 16.501_42) / self.speedup
    }

    /// Milliseconds to load `loaded` tokens from the host tier in a batch that prefills
    /// `prefilled`.
    pub(crate) fn load_ms(&self, prefilled: usize, loaded: usize) -> f64 {
        if loaded == 0 {
            return 0.0;
        }
        self.load_cost * (self.prefill_ms(prefilled + loaded) - self.prefill_ms(prefilled))
    }

    /// Milliseconds of one decode step at KV usage `usage` (0..=1) with `running` sequences.
    pub(crate) fn decode_ms(&self, usage: f64, running: usize) -> f64 {
        if running == 0 {
            return 0.0;
        }
        let u = usage;
        let raw = (-25.74 * u * u + 54.01 * u + 5.74).max(1.0);
        raw / (self.speedup * self.decode_speedup)
    }

    /// Length of one iteration that prefills `prefill_tokens` and loads `loaded_tokens` from
    /// the host tier, at most an hour.
    pub(crate) fn iteration(
        &self,
        prefill_tokens: usize,
        loaded_tokens: usize,
        usage: f64,
        running: usize,
    ) -> Duration {
        let ms = self.prefill_ms(prefill_tokens)
            + self.load_ms(prefill_tokens, loaded_tokens)
            + self.decode_ms(usage, running);
        Duration::try_from_secs_f64(ms / 1000.0).map_or(MAX_ITERATION, |d| d.min(MAX_ITERATION))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 0.006
    }

    #[test]
    fn prefill_reference_table() {
        let m = TimingModel::new(1.0, 1.0, 0.25);
        for (t, ms) in [
            (16, 16.74),
            (512, 24.39),
            (1000, 32.11),
            (4096, 85.76),
            (8192, 169.14),
            (12_035, 260.21),
        ] {
            assert!(
                close(m.prefill_ms(t), ms),
                "T={t}: {} vs {ms}",
                m.prefill_ms(t)
            );
        }
        assert_eq!(m.prefill_ms(0), 0.0);
    }

    #[test]
    fn decode_reference_table() {
        let m = TimingModel::new(1.0, 1.0, 0.25);
        for (u, ms) in [
            (0.0, 5.74),
            (0.1, 10.88),
            (0.25, 17.63),
            (0.5, 26.31),
            (0.75, 31.77),
            (0.9, 33.50),
            (1.0, 34.01),
        ] {
            assert!(
                close(m.decode_ms(u, 1), ms),
                "u={u}: {} vs {ms}",
                m.decode_ms(u, 1)
            );
        }
        assert_eq!(m.decode_ms(0.5, 0), 0.0);
    }

    #[test]
    fn speedups_divide_and_non_positive_means_real_time() {
        let fast = TimingModel::new(2.0, 2.0, 0.25);
        assert!(close(fast.prefill_ms(16), 16.74 / 2.0));
        assert!(close(fast.decode_ms(0.0, 1), 5.74 / 4.0));
        let zero = TimingModel::new(0.0, -1.0, 0.25);
        assert!(close(zero.prefill_ms(16), 16.74));
        assert!(close(zero.decode_ms(0.0, 1), 5.74));
    }

    #[test]
    fn floor_applies_before_division() {
        let m = TimingModel::new(10.0, 1.0, 0.25);
        // At u = 2.2 the polynomial is negative, so the 1 ms floor applies, then / 10.
        assert!(close(m.decode_ms(2.2, 1), 0.1));
    }

    #[test]
    fn iteration_sums_both_parts() {
        let m = TimingModel::new(1.0, 1.0, 0.25);
        let d = m.iteration(16, 0, 0.0, 1);
        assert!((d.as_secs_f64() * 1000.0 - (16.74 + 5.74)).abs() < 0.01);
        assert_eq!(m.iteration(0, 0, 0.0, 0), Duration::ZERO);
        let absurd = TimingModel::new(1e-300, 1.0, 0.25);
        assert_eq!(absurd.iteration(16, 0, 0.0, 1), MAX_ITERATION);
    }

    #[test]
    fn loaded_tokens_cost_a_share_of_their_prefill_time() {
        // 496 tokens loaded beside 16 prefilled: prefilling all 512 would take 24.39 ms,
        // the 16 alone 16.74, so the 496 would add 7.65 ms; a quarter of that is 1.91.
        let m = TimingModel::new(1.0, 1.0, 0.25);
        assert!(close(m.load_ms(16, 496), (24.39 - 16.74) / 4.0));
        assert_eq!(m.load_ms(16, 0), 0.0);
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let loaded = ms(m.iteration(16, 496, 0.0, 1));
        assert!((loaded - (16.74 + 1.91 + 5.74)).abs() < 0.02, "{loaded}");
        // Cost 1 is a recompute, cost 0 a device hit.
        let recompute = TimingModel::new(1.0, 1.0, 1.0);
        let all = ms(m.iteration(512, 0, 0.0, 1));
        assert!((ms(recompute.iteration(16, 496, 0.0, 1)) - all).abs() < 0.01);
        let free = TimingModel::new(1.0, 1.0, 0.0);
        assert_eq!(
            free.iteration(16, 496, 0.0, 1),
            free.iteration(16, 0, 0.0, 1)
        );
        // The speed-up divides the load as it divides the prefill.
        let fast = TimingModel::new(2.0, 1.0, 0.25);
        assert!(close(fast.load_ms(16, 496), m.load_ms(16, 496) / 2.0));
    }
}

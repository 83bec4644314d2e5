//! Passive outlier ejection: consecutive failures on real traffic take an
//! instance out of rotation for a while; each re-ejection doubles the time.
//!
//! Failures are 5xx responses, connect errors, resets and timeouts before the
//! first response byte; 4xx responses are answers from a working engine and
//! count as successes. The state is a handful of atomics: the hot path reads
//! one (`is_ejected`) and a success writes only when there was a failure streak.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use kvmesh_config::OutlierDetectionConfig;

/// Ejection parameters, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OutlierPolicy {
    /// Consecutive failures that eject (0: never).
    threshold: u32,
    base_ms: u64,
    max_ms: u64,
}

impl OutlierPolicy {
    /// From the config section.
    pub(crate) fn new(config: &OutlierDetectionConfig) -> Self {
        Self {
            threshold: config.consecutive_failures,
            base_ms: millis(config.base_ejection_time).max(1),
            max_ms: millis(config.max_ejection_time).max(1),
        }
    }

    /// Ejection length for the `level`-th ejection in a row (0-based).
    fn ejection_ms(&self, level: u32) -> u64 {
        let factor = 1u64.checked_shl(level.min(63)).unwrap_or(u64::MAX);
        self.base_ms.saturating_mul(factor).min(self.max_ms)
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// One instance's outlier state.
#[derive(Debug, Default)]
pub(crate) struct OutlierState {
    consecutive_failures: AtomicU32,
    /// Clock time (ms) the current ejection ends; 0 when never ejected.
    ejected_until_ms: AtomicU64,
    /// Ejections in a row, decaying by one per base ejection time without one.
    level: AtomicU32,
}

impl OutlierState {
    /// Whether the instance is ejected at `now_ms`.
    pub(crate) fn is_ejected(&self, now_ms: u64) -> bool {
        now_ms < self.ejected_until_ms.load(Ordering::Relaxed)
    }

    /// Milliseconds until the ejection ends (0 when not ejected).
    pub(crate) fn remaining_ms(&self, now_ms: u64) -> u64 {
        self.ejected_until_ms
            .load(Ordering::Relaxed)
            .saturating_sub(now_ms)
    }

    /// A response that is not a failure: ends any failure streak.
    pub(crate) fn record_success(&self) {
        if self.consecutive_failures.load(Ordering::Relaxed) != 0 {
            self.consecutive_failures.store(0, Ordering::Relaxed);
        }
    }

    /// A failure; returns the ejection length when this failure ejects the instance.
    pub(crate) fn record_failure(&self, policy: &OutlierPolicy, now_ms: u64) -> Option<Duration> {
        if policy.threshold == 0 || self.is_ejected(now_ms) {
            return None;
        }
        let streak = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if streak < policy.threshold {
            return None;
        }
        // Only the caller that takes the streak ejects.
        if self.consecutive_failures.swap(0, Ordering::Relaxed) < policy.threshold {
            return None;
        }
        let previous_end = self.ejected_until_ms.load(Ordering::Relaxed);
        let decay = now_ms.saturating_sub(previous_end) / policy.base_ms;
        let level = u64::from(self.level.load(Ordering::Relaxed)).saturating_sub(decay);
        let level = u32::try_from(level).unwrap_or(u32::MAX);
        let length = policy.ejection_ms(level);
        self.level.store(level.saturating_add(1), Ordering::Relaxed);
        self.ejected_until_ms
            .store(now_ms.saturating_add(length), Ordering::Relaxed);
        Some(Duration::from_millis(length))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(threshold: u32, base_s: u64, max_s: u64) -> OutlierPolicy {
        OutlierPolicy::new(&OutlierDetectionConfig {
            consecutive_failures: threshold,
            base_ejection_time: Duration::from_secs(base_s),
            max_ejection_time: Duration::from_secs(max_s),
        })
    }

    /// Fails `n` times at `now`; returns the ejection of the last failure.
    fn fail(state: &OutlierState, policy: &OutlierPolicy, n: u32, now: u64) -> Option<Duration> {
        let mut last = None;
        for _ in 0..n {
            last = state.record_failure(policy, now);
        }
        last
    }

    #[test]
    fn ejects_after_the_threshold_only() {
        let p = policy(3, 5, 120);
        let state = OutlierState::default();
        assert_eq!(fail(&state, &p, 2, 1_000), None);
        assert!(!state.is_ejected(1_000));
        assert_eq!(
            state.record_failure(&p, 1_000),
            Some(Duration::from_secs(5))
        );
        assert!(state.is_ejected(1_000));
        assert!(state.is_ejected(5_999));
        assert!(!state.is_ejected(6_000));
        assert_eq!(state.remaining_ms(2_000), 4_000);
        assert_eq!(state.remaining_ms(7_000), 0);
    }

    #[test]
    fn a_success_resets_the_streak() {
        let p = policy(3, 5, 120);
        let state = OutlierState::default();
        fail(&state, &p, 2, 0);
        state.record_success();
        assert_eq!(fail(&state, &p, 2, 0), None);
        assert!(!state.is_ejected(0));
    }

    #[test]
    fn failures_while_ejected_do_not_extend_it() {
        let p = policy(1, 5, 120);
        let state = OutlierState::default();
        assert!(state.record_failure(&p, 0).is_some());
        assert_eq!(state.record_failure(&p, 1_000), None);
        assert!(!state.is_ejected(5_000));
    }

    #[test]
    fn re_ejection_doubles_up_to_the_maximum() {
        let p = policy(1, 5, 30);
        let state = OutlierState::default();
        let mut now = 0;
        let mut lengths = Vec::new();
        for _ in 0..5 {
            let length = state.record_failure(&p, now).unwrap();
            lengths.push(length.as_secs());
            // Fail again right when the ejection ends.
            now += u64::try_from(length.as_millis()).unwrap();
        }
        assert_eq!(lengths, vec![5, 10, 20, 30, 30]);
    }

    #[test]
    fn the_doubling_decays_while_healthy() {
        let p = policy(1, 5, 120);
        let state = OutlierState::default();
        assert_eq!(state.record_failure(&p, 0).unwrap().as_secs(), 5);
        assert_eq!(state.record_failure(&p, 5_000).unwrap().as_secs(), 10);
        // Ejection ended at 15 s; 10 s (two base times) later the level is back to 0.
        assert_eq!(state.record_failure(&p, 25_000).unwrap().as_secs(), 5);
    }

    #[test]
    fn zero_threshold_never_ejects() {
        let p = policy(0, 5, 120);
        let state = OutlierState::default();
        assert_eq!(fail(&state, &p, 100, 0), None);
        assert!(!state.is_ejected(0));
    }
}

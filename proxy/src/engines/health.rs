//! The active health state machine: thresholds of consecutive probe results.

/// Health of one instance as seen by its probes.
#[derive(Debug, Clone)]
pub(crate) struct HealthTracker {
    healthy: bool,
    successes: u32,
    failures: u32,
    healthy_threshold: u32,
    unhealthy_threshold: u32,
}

impl HealthTracker {
    /// Starts healthy (traffic flows before the first probe answers).
    pub(crate) fn new(healthy_threshold: u32, unhealthy_threshold: u32) -> Self {
        Self {
            healthy: true,
            successes: 0,
            failures: 0,
            healthy_threshold: healthy_threshold.max(1),
            unhealthy_threshold: unhealthy_threshold.max(1),
        }
    }

    /// Records a probe result; returns the new state when it changed.
    pub(crate) fn observe(&mut self, success: bool) -> Option<bool> {
        if success {
            self.failures = 0;
            self.successes = self.successes.saturating_add(1);
            if !self.healthy && self.successes >= self.healthy_threshold {
                self.healthy = true;
                return Some(true);
            }
        } else {
            self.successes = 0;
            self.failures = self.failures.saturating_add(1);
            if self.healthy && self.failures >= self.unhealthy_threshold {
                self.healthy = false;
                return Some(false);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_are_consecutive() {
        let mut t = HealthTracker::new(2, 3);
        assert_eq!(t.observe(false), None);
        assert_eq!(t.observe(false), None);
        assert_eq!(t.observe(true), None);
        assert_eq!(t.observe(false), None);
        assert_eq!(t.observe(false), None);
        assert_eq!(t.observe(false), Some(false));
        assert_eq!(t.observe(false), None);
        assert_eq!(t.observe(true), None);
        assert_eq!(t.observe(false), None);
        assert_eq!(t.observe(true), None);
        assert_eq!(t.observe(true), Some(true));
        assert_eq!(t.observe(true), None);
    }

    #[test]
    fn threshold_one_flips_at_once() {
        let mut t = HealthTracker::new(1, 1);
        assert_eq!(t.observe(false), Some(false));
        assert_eq!(t.observe(true), Some(true));
    }
}

//! Exponential reconnect backoff with jitter, shared by the etcd watch and the NATS client.

use std::time::Duration;

/// Delays of 100 ms, doubling up to 5 s, each with ±20 % jitter; `reset` after a success.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    next: Duration,
    initial: Duration,
    max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

impl Backoff {
    /// Starts at `initial`, doubles up to `max`.
    pub(crate) fn new(initial: Duration, max: Duration) -> Self {
        Self {
            next: initial,
            initial,
            max,
        }
    }

    /// The next delay to wait.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        base.mul_f64(rand::random::<f64>() * 0.4 + 0.8)
    }

    /// Starts over from the initial delay.
    pub(crate) fn reset(&mut self) {
        self.next = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
        let delays: Vec<Duration> = (0..5).map(|_| b.next_delay()).collect();
        assert!(delays[0] >= Duration::from_millis(80) && delays[0] <= Duration::from_millis(120));
        assert!(delays[4] >= Duration::from_millis(320) && delays[4] <= Duration::from_millis(480));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(120));
    }
}

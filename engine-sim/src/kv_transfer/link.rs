//! An engine's inbound KV link: transfers share its bandwidth equally (processor sharing,
//! re-divided every millisecond), and while any runs the engine's iterations slow down.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

// tokio's clock: the engine's own time, which a paused test runtime advances exactly.
use tokio::time::Instant;

/// How often a transfer's share of the link is re-divided.
const TICK: Duration = Duration::from_millis(1);

/// The inbound link of one engine.
#[derive(Debug)]
pub(crate) struct Link {
    bytes_per_sec: f64,
    /// Sleep while transferring (false in no-delay mode: transfers take no time).
    timed: bool,
    active: AtomicUsize,
}

impl Link {
    /// A link of `gbps` GB/s (10⁹ bytes); `timed: false` makes every transfer instant.
    pub(crate) fn new(gbps: f64, timed: bool) -> Self {
        Self {
            bytes_per_sec: gbps * 1e9,
            timed,
            active: AtomicUsize::new(0),
        }
    }

    /// Transfers currently on the link.
    pub(crate) fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Moves `bytes` over the link, sharing it with the transfers running meanwhile; returns
    /// how long it took.
    pub(crate) async fn transfer(&self, bytes: u64) -> Duration {
        let started = Instant::now();
        let _on = OnLink::enter(&self.active);
        if !self.timed {
            return started.elapsed();
        }
        let mut left = bytes as f64;
        while left > 0.0 {
            let share = self.bytes_per_sec / self.active().max(1) as f64;
            let step = TICK.min(Duration::from_secs_f64(left / share));
            let tick = Instant::now();
            tokio::time::sleep(step).await;
            // Oversleeping moves more bytes: the link was ours that long.
            left -= share * tick.elapsed().as_secs_f64();
        }
        started.elapsed()
    }
}

/// One transfer counted on the link while it lives.
struct OnLink<'a>(&'a AtomicUsize);

impl<'a> OnLink<'a> {
    fn enter(active: &'a AtomicUsize) -> Self {
        active.fetch_add(1, Ordering::Relaxed);
        Self(active)
    }
}

impl Drop for OnLink<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_transfer_takes_bytes_over_bandwidth() {
        let link = Link::new(1.0, true);
        let took = link.transfer(50_000_000).await;
        assert!(
            (took.as_secs_f64() - 0.05).abs() < 0.002,
            "50 MB at 1 GB/s: {took:?}"
        );
        assert_eq!(link.active(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_transfers_share_the_link_fairly() {
        let link = Link::new(1.0, true);
        let (small, large) = tokio::join!(link.transfer(10_000_000), link.transfer(40_000_000));
        // Both at 0.5 GB/s until the small one ends (20 ms), then the large one alone:
        // 10 MB in 20 ms, the remaining 30 MB in 30 ms.
        assert!((small.as_secs_f64() - 0.02).abs() < 0.003, "{small:?}");
        assert!((large.as_secs_f64() - 0.05).abs() < 0.003, "{large:?}");
    }

    #[tokio::test]
    async fn an_untimed_link_is_instant_and_still_counts() {
        let link = Link::new(1.0, false);
        assert!(link.transfer(u64::MAX).await < Duration::from_millis(50));
        assert_eq!(link.active(), 0);
    }
}

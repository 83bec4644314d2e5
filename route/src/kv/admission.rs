//! Admission when every instance is busy (kv-routing §7): 503 at once, or a wait in a bounded
//! queue until an instance stops being busy, up to a timeout.
//!
//! Waiters are woken whenever load is released (a first response byte, a request's end, a
//! stale expiry) and re-check; the first to find a free instance goes. No lock is held while
//! waiting. Wake-ups are not strictly first-come-first-served: every waiter re-checks, and the
//! one whose task runs first wins.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use prometheus::IntGauge;
use tokio::sync::Notify;
use tokio::time::{Instant, timeout_at};

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// Every instance is busy and the queue is off.
    Busy,
    /// Every instance is busy and the queue is full.
    QueueFull,
    /// The request waited the whole queue timeout.
    Timeout,
}

impl Rejected {
    /// Why, for the error message.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Busy => "every instance is busy",
            Self::QueueFull => "every instance is busy and the admission queue is full",
            Self::Timeout => "every instance stayed busy for the whole queue timeout",
        }
    }
}

/// The admission queue of one model.
#[derive(Debug)]
pub(crate) struct Admission {
    max_size: usize,
    timeout: Duration,
    waiting: AtomicUsize,
    notify: Notify,
    depth: IntGauge,
}

/// Keeps one queue slot (and the depth gauge) taken while alive.
struct Slot<'a>(&'a Admission);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
        self.0.depth.dec();
    }
}

impl Admission {
    /// A queue of up to `max_size` waiters (0: no queue) waiting up to `timeout`; `depth`
    /// follows the number of waiters.
    pub(crate) fn new(max_size: usize, timeout: Duration, depth: IntGauge) -> Self {
        Self {
            max_size,
            timeout,
            waiting: AtomicUsize::new(0),
            notify: Notify::new(),
            depth,
        }
    }

    /// Returns once `available()` holds, or why not.
    pub(crate) async fn admit(&self, available: impl Fn() -> bool) -> Result<(), Rejected> {
        if available() {
            return Ok(());
        }
        if self.max_size == 0 {
            return Err(Rejected::Busy);
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_size {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(Rejected::QueueFull);
        }
        self.depth.inc();
        let _slot = Slot(self);
        let deadline = Instant::now() + self.timeout;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if available() {
                return Ok(());
            }
            if timeout_at(deadline, notified).await.is_err() {
                return Err(Rejected::Timeout);
            }
        }
    }

    /// Load was released: waiters re-check.
    pub(crate) fn wake(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    use super::*;

    fn gauge() -> IntGauge {
        IntGauge::new("depth", "test").unwrap()
    }

    #[tokio::test]
    async fn free_instances_admit_at_once_and_no_queue_rejects() {
        let open = Admission::new(0, Duration::from_secs(1), gauge());
        assert_eq!(open.admit(|| true).await, Ok(()));
        assert_eq!(open.admit(|| false).await, Err(Rejected::Busy));
    }

    #[tokio::test]
    async fn waiters_are_admitted_when_load_is_released() {
        let depth = gauge();
        let queue = Arc::new(Admission::new(2, Duration::from_secs(30), depth.clone()));
        let free = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (queue, free) = (Arc::clone(&queue), Arc::clone(&free));
            tokio::spawn(async move { queue.admit(|| free.load(Ordering::SeqCst)).await })
        };
        while depth.get() < 1 {
            tokio::task::yield_now().await;
        }
        // A wake-up without a free instance changes nothing.
        queue.wake();
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        free.store(true, Ordering::SeqCst);
        queue.wake();
        assert_eq!(waiter.await.unwrap(), Ok(()));
        assert_eq!(depth.get(), 0);
    }

    #[tokio::test]
    async fn a_full_queue_and_the_timeout_reject() {
        let depth = gauge();
        let queue = Arc::new(Admission::new(1, Duration::from_millis(50), depth.clone()));
        let first = {
            let queue = Arc::clone(&queue);
            tokio::spawn(async move { queue.admit(|| false).await })
        };
        while depth.get() < 1 {
            tokio::task::yield_now().await;
        }
        assert_eq!(queue.admit(|| false).await, Err(Rejected::QueueFull));
        assert_eq!(first.await.unwrap(), Err(Rejected::Timeout));
        assert_eq!(depth.get(), 0);
        assert_eq!(queue.waiting.load(Ordering::SeqCst), 0);
    }
}

//! A timer for deadlines that keep moving later, as a connection's per-request deadlines
//! do: it stays armed at the deadline it was given, a later deadline does not move it, and
//! when it fires early it is re-armed at the deadline in force. A busy connection thus
//! touches tokio's timer wheel about once per timeout period instead of twice per request
//! (a `tokio::time::timeout` registers and deregisters its timer every time).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::{Instant, Sleep, sleep_until};

/// A deadline passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Elapsed;

/// A reusable, lazily re-armed timer; the default one is unarmed and costs nothing until
/// its first wait (which needs a tokio runtime with time enabled).
#[derive(Debug, Default)]
pub(crate) struct LazyTimer {
    sleep: Option<Pin<Box<Sleep>>>,
}

impl LazyTimer {
    /// Completes at `deadline` (or a little after it).
    pub(crate) async fn until(&mut self, deadline: Instant) {
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(sleep_until(deadline)));
        if sleep.deadline() > deadline {
            sleep.as_mut().reset(deadline);
        }
        loop {
            sleep.as_mut().await;
            if Instant::now() >= deadline {
                return;
            }
            sleep.as_mut().reset(deadline);
        }
    }

    /// Runs `future` for at most `limit`.
    pub(crate) async fn within<F: Future>(
        &mut self,
        limit: Duration,
        future: F,
    ) -> Result<F::Output, Elapsed> {
        let deadline = Instant::now() + limit;
        tokio::select! {
            biased;
            output = future => Ok(output),
            () = self.until(deadline) => Err(Elapsed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn fires_at_each_deadline_however_it_was_armed() {
        let mut timer = LazyTimer::default();
        let start = Instant::now();
        timer.until(start + Duration::from_secs(5)).await;
        assert_eq!(Instant::now() - start, Duration::from_secs(5));
        // A later deadline while armed earlier: the early firing is not reported.
        let later = Instant::now() + Duration::from_secs(10);
        assert_eq!(
            timer
                .within(Duration::from_secs(3), std::future::pending::<()>())
                .await,
            Err(Elapsed)
        );
        timer.until(later).await;
        assert_eq!(Instant::now() - start, Duration::from_secs(15));
    }

    #[tokio::test(start_paused = true)]
    async fn an_armed_timer_does_not_cut_a_later_deadline_short() {
        let mut timer = LazyTimer::default();
        let start = Instant::now();
        let ready = timer.within(Duration::from_secs(1), async { 7 }).await;
        assert_eq!(ready, Ok(7));
        // Armed for 1 s from `start`; this wait must last 4 s.
        let slow = tokio::time::sleep(Duration::from_secs(3));
        assert_eq!(timer.within(Duration::from_secs(4), slow).await, Ok(()));
        assert_eq!(Instant::now() - start, Duration::from_secs(3));
        let slower = tokio::time::sleep(Duration::from_secs(5));
        assert_eq!(
            timer.within(Duration::from_secs(4), slower).await,
            Err(Elapsed)
        );
        assert_eq!(Instant::now() - start, Duration::from_secs(7));
    }
}

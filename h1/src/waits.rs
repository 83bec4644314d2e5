//! What a server connection waits on while it reads a request head: the head deadline and
//! the shutdown signal, each set up once per connection rather than once per request
//! (the deadline on a lazily re-armed timer, the signal's `changed()` future kept registered).

use std::future::Future;
use std::pin::Pin;

use tokio::sync::watch::error::RecvError;
use tokio::time::Instant;

use crate::lazy_timer::LazyTimer;

/// The connection's head timer and shutdown signal.
pub struct Waits<'a, C> {
    timer: LazyTimer,
    shutdown: Pin<&'a mut C>,
    /// Shutdown has begun (the signal fired, or had fired before the connection started).
    pub draining: bool,
}

/// What ended a [`Waits::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// The deadline passed.
    Deadline,
    /// Shutdown began.
    Shutdown,
}

impl<'a, C: Future<Output = Result<(), RecvError>>> Waits<'a, C> {
    /// Waits on `shutdown` (the signal's `changed()` future); `draining` when shutdown has
    /// already begun.
    pub fn new(shutdown: Pin<&'a mut C>, draining: bool) -> Self {
        Self {
            timer: LazyTimer::default(),
            shutdown,
            draining,
        }
    }

    /// Completes at `deadline` (or a little after it), or when shutdown begins.
    pub async fn wait(&mut self, deadline: Instant) -> Woken {
        let draining = self.draining;
        tokio::select! {
            biased;
            // A closed signal (its sender gone) means shutdown too.
            _ = self.shutdown.as_mut(), if !draining => {
                self.draining = true;
                Woken::Shutdown
            }
            () = self.timer.until(deadline) => Woken::Deadline,
        }
    }
}

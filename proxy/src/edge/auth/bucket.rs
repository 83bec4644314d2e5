//! A token bucket: refills at a steady rate up to its capacity.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// A token bucket whose level may go negative (debt) down to `-capacity`.
#[derive(Debug)]
pub(crate) struct TokenBucket {
    rate_per_sec: f64,
    capacity: f64,
    level: Mutex<Level>,
}

#[derive(Debug)]
struct Level {
    tokens: f64,
    updated: Instant,
}

impl TokenBucket {
    /// A full bucket refilling `rate_per_sec` up to `capacity`.
    pub(crate) fn new(rate_per_sec: f64, capacity: f64, now: Instant) -> Self {
        Self {
            rate_per_sec,
            capacity,
            level: Mutex::new(Level {
                tokens: capacity,
                updated: now,
            }),
        }
    }

    /// Runs `f` on the level refilled up to `now`.
    fn with_level<T>(&self, now: Instant, f: impl FnOnce(&mut f64) -> T) -> T {
        let mut level = self.level.lock().unwrap_or_else(PoisonError::into_inner);
        let elapsed = now.saturating_duration_since(level.updated).as_secs_f64();
        level.tokens = (level.tokens + elapsed * self.rate_per_sec).min(self.capacity);
        level.updated = level.updated.max(now);
        f(&mut level.tokens)
    }

    /// Time until the level reaches `target` from `tokens` (`Duration::MAX` past what a
    /// `Duration` holds, as with a vanishingly small rate).
    fn wait(&self, tokens: f64, target: f64) -> Duration {
        Duration::try_from_secs_f64(((target - tokens) / self.rate_per_sec).max(0.0))
            .unwrap_or(Duration::MAX)
    }

    /// Takes `n` tokens when the bucket holds them; otherwise how long until it will.
    pub(crate) fn try_take(&self, n: f64, now: Instant) -> Result<(), Duration> {
        self.with_level(now, |tokens| {
            if *tokens >= n {
                *tokens -= n;
                Ok(())
            } else {
                Err(self.wait(*tokens, n))
            }
        })
    }

    /// Ok while the level is above zero; otherwise how long until it will be.
    pub(crate) fn check_positive(&self, now: Instant) -> Result<(), Duration> {
        self.with_level(now, |tokens| {
            if *tokens > 0.0 {
                Ok(())
            } else {
                Err(self.wait(*tokens, f64::MIN_POSITIVE))
            }
        })
    }

    /// Takes `n` tokens (negative: gives them back), going into debt if need be.
    pub(crate) fn charge(&self, n: f64, now: Instant) {
        self.with_level(now, |tokens| {
            *tokens = (*tokens - n).clamp(-self.capacity, self.capacity);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vanishing_rate_waits_forever_instead_of_panicking() {
        let start = Instant::now();
        let bucket = TokenBucket::new(1e-300, 1.0, start);
        assert_eq!(bucket.try_take(1.0, start), Ok(()));
        assert_eq!(bucket.try_take(1.0, start), Err(Duration::MAX));
    }

    #[test]
    fn takes_until_empty_then_refills() {
        let start = Instant::now();
        let bucket = TokenBucket::new(2.0, 2.0, start);
        assert_eq!(bucket.try_take(1.0, start), Ok(()));
        assert_eq!(bucket.try_take(1.0, start), Ok(()));
        let wait = bucket.try_take(1.0, start).unwrap_err();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-9, "{wait:?}");
        assert!(
            bucket
                .try_take(1.0, start + Duration::from_millis(400))
                .is_err()
        );
        assert_eq!(
            bucket.try_take(1.0, start + Duration::from_millis(500)),
            Ok(())
        );
        // Refills stop at the capacity.
        let later = start + Duration::from_secs(60);
        assert_eq!(bucket.try_take(2.0, later), Ok(()));
        assert!(bucket.try_take(1.0, later).is_err());
    }

    #[test]
    fn debt_blocks_until_repaid_and_is_bounded() {
        let start = Instant::now();
        let bucket = TokenBucket::new(10.0, 100.0, start);
        assert_eq!(bucket.check_positive(start), Ok(()));
        bucket.charge(150.0, start);
        let wait = bucket.check_positive(start).unwrap_err();
        assert!((wait.as_secs_f64() - 5.0).abs() < 1e-6, "{wait:?}");
        assert!(
            bucket
                .check_positive(start + Duration::from_secs(5))
                .is_err()
        );
        assert_eq!(
            bucket.check_positive(start + Duration::from_millis(5001)),
            Ok(())
        );
        // Debt never exceeds the capacity.
        bucket.charge(1e9, start + Duration::from_secs(6));
        let wait = bucket
            .check_positive(start + Duration::from_secs(6))
            .unwrap_err();
        assert!(wait <= Duration::from_secs(10), "{wait:?}");
        // A refund raises the level.
        bucket.charge(-1e9, start + Duration::from_secs(6));
        assert_eq!(
            bucket.check_positive(start + Duration::from_secs(6)),
            Ok(())
        );
    }
}

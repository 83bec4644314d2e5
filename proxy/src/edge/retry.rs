//! Retrying an engine's answer on another instance before any byte reached the client
//! (`retry` in the config): which answers ([`RetryPolicy`]), how long to wait first
//! ([`RetryPolicy::backoff`]), and the budget that bounds retries to a share of each model's
//! requests ([`RetryBudget`], Envoy's retry budgets), so a failing fleet is not hit with a
//! multiple of its load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvmesh_config::RetryConfig;
use rand::Rng;

/// Why an attempt was retried (the `reason` label of `kvmesh_retries_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryReason {
    /// The engine answered a retryable status (5xx, 429).
    Status,
    /// No response head within the first-byte timeout.
    Timeout,
    /// The connection failed or broke before the response head.
    Connect,
}

/// Number of [`RetryReason`]s.
pub(crate) const RETRY_REASONS: usize = 3;

impl RetryReason {
    /// Every reason, in [`RetryReason::index`] order.
    pub(crate) const ALL: [RetryReason; RETRY_REASONS] =
        [Self::Status, Self::Timeout, Self::Connect];

    /// Position in [`RetryReason::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Label in metrics.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Status => "status",
            Self::Timeout => "timeout",
            Self::Connect => "connect",
        }
    }
}

/// The `retry` settings, as the request path reads them.
#[derive(Debug, Clone)]
pub(crate) struct RetryPolicy {
    /// Retryable statuses, one bit per status 400..=599 (bit `status - 400`).
    statuses: [u64; 4],
    on_first_byte_timeout: bool,
    backoff_base: Duration,
    backoff_max: Duration,
    budget_ratio: f64,
    /// Buckets of the budget's window, ms each.
    bucket_ms: u64,
    /// Retries always allowed per window.
    budget_min: f64,
}

impl RetryPolicy {
    /// The policy `config` describes.
    pub(crate) fn new(config: &RetryConfig) -> Self {
        let mut statuses = [0u64; 4];
        for status in config.statuses.iter().filter(|s| (400..600).contains(*s)) {
            let bit = usize::from(status - 400);
            statuses[bit / 64] |= 1 << (bit % 64);
        }
        let window_ms = u64::try_from(config.budget_window.as_millis()).unwrap_or(u64::MAX);
        Self {
            statuses,
            on_first_byte_timeout: config.on_first_byte_timeout,
            backoff_base: config.backoff_base,
            backoff_max: config.backoff_max,
            budget_ratio: config.budget_ratio,
            bucket_ms: (window_ms / BUCKETS as u64).max(1),
            budget_min: config.budget_min_per_second * config.budget_window.as_secs_f64(),
        }
    }

    /// Whether an answer with `status` is retried.
    pub(crate) fn retries_status(&self, status: u16) -> bool {
        (400..600).contains(&status) && {
            let bit = usize::from(status - 400);
            self.statuses[bit / 64] & (1 << (bit % 64)) != 0
        }
    }

    /// Whether a first-byte timeout is retried.
    pub(crate) fn retries_timeout(&self) -> bool {
        self.on_first_byte_timeout
    }

    /// The wait before the request's `retry`-th retry (1-based): a random time up to
    /// `backoff_base × 2^(retry − 1)`, at most `backoff_max`.
    pub(crate) fn backoff(&self, retry: u32) -> Duration {
        let ceiling = self
            .backoff_base
            .saturating_mul(1 << retry.saturating_sub(1).min(16))
            .min(self.backoff_max);
        ceiling.mul_f64(rand::thread_rng().gen_range(0.0..=1.0))
    }
}

/// Buckets of a budget's window.
const BUCKETS: usize = 10;

/// One bucket: the requests and retries counted in one tenth of the window.
#[derive(Debug, Default)]
struct Bucket {
    /// Which tenth (clock ms / bucket ms) the counts belong to.
    slot: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
}

/// One model's requests and retries over the last budget window, in ten buckets of atomics
/// (no lock on the request path; counts racing a bucket's turnover may be lost, which only
/// makes the budget a little more or less generous for that instant).
#[derive(Debug, Default)]
pub(crate) struct RetryBudget {
    buckets: [Bucket; BUCKETS],
}

impl RetryBudget {
    /// The bucket for clock time `now_ms`, cleared when it held an older tenth.
    fn bucket(&self, policy: &RetryPolicy, now_ms: u64) -> &Bucket {
        let slot = now_ms / policy.bucket_ms;
        let bucket = &self.buckets[(slot % BUCKETS as u64) as usize];
        let seen = bucket.slot.load(Ordering::Relaxed);
        if seen != slot
            && bucket
                .slot
                .compare_exchange(seen, slot, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            bucket.requests.store(0, Ordering::Relaxed);
            bucket.retries.store(0, Ordering::Relaxed);
        }
        bucket
    }

    /// Counts a request at `now_ms`.
    pub(crate) fn request(&self, policy: &RetryPolicy, now_ms: u64) {
        self.bucket(policy, now_ms)
            .requests
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one retry from the budget at `now_ms`; `false` when the window's retries already
    /// reach `budget_ratio` of its requests (and the per-window minimum).
    pub(crate) fn try_retry(&self, policy: &RetryPolicy, now_ms: u64) -> bool {
        let current = self.bucket(policy, now_ms);
        let slot = now_ms / policy.bucket_ms;
        let (mut requests, mut retries) = (0u64, 0u64);
        for bucket in &self.buckets {
            if slot.saturating_sub(bucket.slot.load(Ordering::Relaxed)) < BUCKETS as u64 {
                requests += bucket.requests.load(Ordering::Relaxed);
                retries += bucket.retries.load(Ordering::Relaxed);
            }
        }
        let allowed = (policy.budget_ratio * requests as f64).max(policy.budget_min);
        if (retries as f64) < allowed {
            current.retries.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(ratio: f64, min_per_second: f64) -> RetryPolicy {
        RetryPolicy::new(&RetryConfig {
            budget_ratio: ratio,
            budget_min_per_second: min_per_second,
            ..RetryConfig::default()
        })
    }

    #[test]
    fn statuses_are_the_configured_ones() {
        let policy = RetryPolicy::new(&RetryConfig::default());
        for status in [429, 500, 502, 503, 504] {
            assert!(policy.retries_status(status), "{status}");
        }
        for status in [200, 400, 404, 413, 501, 599, 600, 0] {
            assert!(!policy.retries_status(status), "{status}");
        }
        let only_503 = RetryPolicy::new(&RetryConfig {
            statuses: vec![503],
            on_first_byte_timeout: false,
            ..RetryConfig::default()
        });
        assert!(only_503.retries_status(503) && !only_503.retries_status(502));
        assert!(!only_503.retries_timeout());
    }

    #[test]
    fn backoff_doubles_up_to_the_maximum() {
        let policy = RetryPolicy::new(&RetryConfig::default());
        for _ in 0..200 {
            assert!(policy.backoff(1) <= Duration::from_millis(25));
            assert!(policy.backoff(2) <= Duration::from_millis(50));
            assert!(policy.backoff(40) <= Duration::from_millis(250));
        }
        let longest = (0..200).map(|_| policy.backoff(9)).max().unwrap();
        assert!(
            longest > Duration::from_millis(50),
            "full jitter spans the ceiling: {longest:?}"
        );
    }

    #[test]
    fn retries_take_at_most_the_budgets_share_of_requests() {
        let policy = policy(0.2, 0.0);
        let budget = RetryBudget::default();
        let now = 1_000_000;
        for _ in 0..50 {
            budget.request(&policy, now);
        }
        let granted = (0..50).filter(|_| budget.try_retry(&policy, now)).count();
        assert_eq!(granted, 10, "20 % of 50 requests");
        // A window later the old counts no longer weigh.
        let later = now + 10_000;
        assert!(
            !budget.try_retry(&policy, later),
            "no requests, no minimum: nothing"
        );
        budget.request(&policy, later);
        budget.request(&policy, later);
        budget.request(&policy, later);
        budget.request(&policy, later);
        budget.request(&policy, later);
        assert!(budget.try_retry(&policy, later));
        assert!(!budget.try_retry(&policy, later), "1 of 5 requests used");
    }

    #[test]
    fn the_minimum_lets_a_quiet_model_retry() {
        let policy = policy(0.2, 0.3); // 3 per 10 s window
        let budget = RetryBudget::default();
        let granted = (0..10).filter(|_| budget.try_retry(&policy, 5_000)).count();
        assert_eq!(granted, 3);
        // Counts spread over the window all weigh; half a window later, still 3.
        assert!(!budget.try_retry(&policy, 9_000));
        // Once the window has passed, the minimum is free again.
        assert!(budget.try_retry(&policy, 16_000));
    }
}

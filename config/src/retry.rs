//! Retries of engine answers that failed before any byte reached the client: which ones, how
//! long to wait between attempts, and the budget that keeps retries from multiplying load.

use std::time::Duration;

use serde::Deserialize;

/// `retry`: which engine answers are tried again on another instance, and within what budget.
/// Connection failures are always retried (`limits.retries` bounds every kind per request).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryConfig {
    /// Engine response statuses retried on another instance (5xx and 429 by default; other
    /// 4xx are the request's fault and never retried).
    pub statuses: Vec<u16>,
    /// Retry when the engine sends no response head within `limits.first_byte_timeout`.
    pub on_first_byte_timeout: bool,
    /// First backoff before a retry; each further retry of the request doubles it (a random
    /// wait up to it, "full jitter").
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub backoff_base: Duration,
    /// Longest backoff.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub backoff_max: Duration,
    /// The budget: retries of a model may add at most this share of its requests over
    /// `budget_window` (0.2: one retry per five requests).
    pub budget_ratio: f64,
    /// The window the budget is counted over.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub budget_window: Duration,
    /// Retries always allowed per second of the window, however few the requests (so a
    /// quiet model can still retry).
    pub budget_min_per_second: f64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            statuses: vec![429, 500, 502, 503, 504],
            on_first_byte_timeout: true,
            backoff_base: Duration::from_millis(25),
            backoff_max: Duration::from_millis(250),
            budget_ratio: 0.2,
            budget_window: Duration::from_secs(10),
            budget_min_per_second: 1.0,
        }
    }
}

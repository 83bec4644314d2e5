//! Charging completion tokens while the response streams: each time the response's
//! [`kvmesh_wire::usage::TokenCount`] grows (SSE: one token per data event, corrected by a
//! reported `usage.completion_tokens`; other bodies: their usage once it passed), the key is
//! charged the difference.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::edge::auth::ApiKey;

/// Charges one response's completion tokens to its key.
#[derive(Debug)]
pub(crate) struct CompletionMeter {
    key: Arc<ApiKey>,
    /// Tokens charged so far.
    charged: AtomicU64,
}

impl CompletionMeter {
    /// A meter charging `key`.
    pub(crate) fn new(key: Arc<ApiKey>) -> Self {
        Self {
            key,
            charged: AtomicU64::new(0),
        }
    }

    /// The response has `completion_tokens` so far: charges (or refunds) the difference.
    pub(crate) fn charge_to(&self, completion_tokens: u64) {
        let before = self.charged.swap(completion_tokens, Ordering::Relaxed);
        let delta = i64::try_from(completion_tokens)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(before).unwrap_or(i64::MAX));
        if delta != 0 {
            self.key.charge(delta, true, Instant::now());
        }
    }
}

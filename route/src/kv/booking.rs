//! The load one request holds on its instance, released by a guard: prefill at the first
//! response byte ([`Booking::prefill_done`]), everything when the guard drops (the response
//! ended, the client left, or the attempt failed and the request is routed again). While a
//! stream runs, its output grows the load a block at a time ([`Booking::generated`]). Each
//! release wakes the requests waiting for admission. Under live KV events it also carries
//! what the index expects the engine to report cached, to judge the answer by
//! ([`Booking::engine_cached`], [`crate::kv::cache_check`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::kv::admission::Admission;
use crate::kv::cache_check::{Expectation, Verdict};
use crate::kv::event_feed::EventFeed;
use crate::kv::load::ActiveLoads;
use crate::metrics::KvMetrics;

/// What the index expects a request's answer to report cached, and where to judge it.
#[derive(Debug)]
pub(crate) struct AnswerCheck<'a> {
    pub(crate) feed: &'a EventFeed,
    pub(crate) metrics: &'a KvMetrics,
    pub(crate) expected: Expectation,
}

/// One request's booked load on one instance.
#[derive(Debug)]
pub struct Booking<'a> {
    loads: &'a ActiveLoads,
    admission: &'a Admission,
    instance: u64,
    id: Option<u64>,
    /// Tokens per block (0: unknown).
    block_size: u64,
    /// Whether its output is booked a block at a time (`kv.track_output_blocks`).
    track_output: bool,
    /// Output tokens generated so far.
    output_tokens: AtomicU64,
    /// What its answer is judged against (`None`: it is not judged).
    check: Option<AnswerCheck<'a>>,
}

impl<'a> Booking<'a> {
    /// The booking `id` in `loads` (`None`: nothing was booked) on instance `instance` (its
    /// id), of a model with `block_size`-token blocks whose output is booked as it grows
    /// when `track_output`; releases wake `admission`'s waiters.
    pub(crate) fn new(
        loads: &'a ActiveLoads,
        admission: &'a Admission,
        instance: u64,
        id: Option<u64>,
        block_size: u64,
        track_output: bool,
    ) -> Self {
        Self {
            loads,
            admission,
            instance,
            id,
            block_size,
            track_output,
            output_tokens: AtomicU64::new(0),
            check: None,
        }
    }

    /// The booking, whose answer is judged by `check`.
    pub(crate) fn checked_by(mut self, check: Option<AnswerCheck<'a>>) -> Self {
        self.check = check;
        self
    }

    /// The engine's whole answer reported its usage, with `cached_tokens` (`None`: without
    /// `prompt_tokens_details.cached_tokens`). Judged against what the index expected of
    /// instance `instance_url` (a booking without an expectation ignores it): counted,
    /// and past the threshold the instance is untrusted and resynced. Call it only for an
    /// answer to the prompt the booking was made for (not a decode leg, not a migrated
    /// stream's continuation).
    pub fn engine_cached(&self, instance_url: &str, cached_tokens: Option<u64>) {
        let Some(check) = &self.check else {
            return;
        };
        let Some(tokens) = cached_tokens else {
            check.metrics.count_without_cached_tokens();
            if check.feed.without_cached_tokens(self.instance) {
                tracing::warn!(
                    instance = instance_url,
                    "the engine's usage has no prompt_tokens_details.cached_tokens: its KV cache \
                     cannot be checked against the index (vLLM: --enable-prompt-tokens-details)"
                );
            }
            return;
        };
        let expected = &check.expected;
        let actual = expected.actual_blocks(tokens);
        let Some(verdict) = check.feed.judge(self.instance, expected, actual) else {
            return;
        };
        let difference = i64::from(expected.reported) - i64::from(actual);
        check
            .metrics
            .count_cache_check(instance_url, verdict, difference);
        if verdict == Verdict::Tripped {
            tracing::warn!(
                instance = instance_url,
                expected_blocks = expected.reported,
                actual_blocks = actual,
                "the engine's cached_tokens keep disagreeing with the KV index: scoring the \
                 instance by predictions alone and resyncing it"
            );
        }
    }

    /// The engine streamed `tokens` more output tokens: counted (the blocks they fill are
    /// freed with the request), and with `kv.track_output_blocks` each full block of output
    /// is booked on the instance until the request ends (the lock is taken once per block,
    /// not per token).
    pub fn generated(&self, tokens: u64) {
        let before = self.output_tokens.fetch_add(tokens, Ordering::Relaxed);
        let Some(id) = self
            .id
            .filter(|_| tokens > 0 && self.track_output && self.block_size > 0)
        else {
            return;
        };
        let blocks = (before + tokens) / self.block_size;
        if blocks > before / self.block_size {
            self.loads.generated(self.instance, id, blocks);
        }
    }

    /// The first response byte arrived: the prefill part of the load ends. When that byte
    /// carries the `first_token` (a streamed response), its delay teaches the instance's
    /// speed.
    pub fn prefill_done(&self, first_token: bool) {
        if let Some(id) = self.id
            && self
                .loads
                .prefill_done(self.instance, id, Instant::now(), first_token)
        {
            self.admission.wake();
        }
    }
}

impl Booking<'_> {
    /// The engine's answer is complete: all the load is released now, before the last bytes
    /// reach the client, so a client that sends its next request the moment it has read the
    /// answer finds the instance idle (dropping the guard later does nothing more).
    pub fn release(&self) {
        let output_tokens = self.output_tokens.load(Ordering::Relaxed);
        if let Some(id) = self.id
            && self
                .loads
                .release_streamed(self.instance, id, output_tokens)
        {
            self.admission.wake();
        }
    }
}

impl Drop for Booking<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prometheus::IntGauge;

    use super::*;
    use crate::kv::load::NewRequest;

    fn booked(loads: &ActiveLoads) -> Option<u64> {
        let request = NewRequest {
            prompt: None,
            prefill_tokens: 0,
            profiled_ttft_ms: 0.0,
            profiled_token_ms: 0.0,
            profiled_own_ms: 0.0,
        };
        loads.book(0, request, Instant::now())
    }

    #[test]
    fn output_is_booked_a_block_at_a_time_when_tracked() {
        let loads = ActiveLoads::new();
        loads.add(0);
        let gauge = IntGauge::new("depth", "depth").unwrap();
        let admission = Admission::new(1, Duration::from_secs(1), gauge);
        let blocks = || loads.snapshot(0, &[]).blocks;
        let booking = Booking::new(&loads, &admission, 0, booked(&loads), 4, true);
        assert_eq!(blocks(), 1, "the request's own unshared block");
        booking.generated(3);
        assert_eq!(blocks(), 1, "3 tokens fill no block");
        booking.generated(1);
        assert_eq!(blocks(), 2);
        booking.generated(9);
        assert_eq!(blocks(), 4, "13 tokens: 3 blocks");
        booking.generated(0);
        assert_eq!(blocks(), 4);
        drop(booking);
        assert_eq!(blocks(), 0);

        let untracked = Booking::new(&loads, &admission, 0, booked(&loads), 4, false);
        untracked.generated(100);
        assert_eq!(blocks(), 1, "output is not tracked");
    }
}

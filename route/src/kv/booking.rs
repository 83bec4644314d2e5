//! The load one request holds on its instance, released by a guard: prefill at the first
//! response byte ([`Booking::prefill_done`]), everything when the guard drops (the response
//! ended, the client left, or the attempt failed and the request is routed again). While a
//! stream runs, its output grows the load a block at a time ([`Booking::generated`]). Each
//! release wakes the requests waiting for admission.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::kv::admission::Admission;
use crate::kv::load::ActiveLoads;

/// One request's booked load on one instance.
#[derive(Debug)]
pub struct Booking<'a> {
    loads: &'a ActiveLoads,
    admission: &'a Admission,
    instance: u64,
    id: Option<u64>,
    /// Tokens per output block (0: output is not tracked).
    block_size: u64,
    /// Output tokens generated so far.
    output_tokens: AtomicU64,
}

impl<'a> Booking<'a> {
    /// The booking `id` in `loads` (`None`: nothing was booked) on instance `instance` (its
    /// id), of a model with `block_size`-token blocks (0: its output is not tracked);
    /// releases wake `admission`'s waiters.
    pub(crate) fn new(
        loads: &'a ActiveLoads,
        admission: &'a Admission,
        instance: u64,
        id: Option<u64>,
        block_size: u64,
    ) -> Self {
        Self {
            loads,
            admission,
            instance,
            id,
            block_size,
            output_tokens: AtomicU64::new(0),
        }
    }

    /// The engine streamed `tokens` more output tokens: each full block of output is booked
    /// on the instance until the request ends (the lock is taken once per block, not per
    /// token).
    pub fn generated(&self, tokens: u64) {
        let Some(id) = self.id.filter(|_| tokens > 0 && self.block_size > 0) else {
            return;
        };
        let before = self.output_tokens.fetch_add(tokens, Ordering::Relaxed);
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
        if let Some(id) = self.id
            && self.loads.release(self.instance, id)
        {
            self.admission.wake();
        }
    }
}

impl Drop for Booking<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id
            && self.loads.release(self.instance, id)
        {
            self.admission.wake();
        }
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
        let booking = Booking::new(&loads, &admission, 0, booked(&loads), 4);
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

        let untracked = Booking::new(&loads, &admission, 0, booked(&loads), 0);
        untracked.generated(100);
        assert_eq!(blocks(), 1, "output is not tracked");
    }
}

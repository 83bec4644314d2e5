//! The load one request holds on its instance, released by a guard: prefill at the first
//! response byte ([`Booking::prefill_done`]), everything when the guard drops (the response
//! ended, the client left, or the attempt failed and the request is routed again). Each
//! release wakes the requests waiting for admission.

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
}

impl<'a> Booking<'a> {
    /// The booking `id` in `loads` (`None`: nothing was booked) on instance `instance` (its
    /// id); releases wake `admission`'s waiters.
    pub(crate) fn new(
        loads: &'a ActiveLoads,
        admission: &'a Admission,
        instance: u64,
        id: Option<u64>,
    ) -> Self {
        Self {
            loads,
            admission,
            instance,
            id,
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

//! The load one request holds on its instance, released by a guard: prefill at the first
//! response byte ([`Booking::prefill_done`]), everything when the guard drops (the response
//! ended, the client left, or the attempt failed and the request is routed again).

use crate::kv_route::router::KvRouter;

/// One request's booked load on one instance.
#[derive(Debug)]
pub(crate) struct Booking<'a> {
    router: &'a KvRouter,
    instance: u64,
    id: Option<u64>,
}

impl<'a> Booking<'a> {
    /// The booking `id` (`None`: nothing was booked) on instance `instance` (its id).
    pub(crate) fn new(router: &'a KvRouter, instance: u64, id: Option<u64>) -> Self {
        Self {
            router,
            instance,
            id,
        }
    }

    /// The first response byte arrived: the prefill part of the load ends.
    pub(crate) fn prefill_done(&self) {
        if let Some(id) = self.id {
            self.router.prefill_done(self.instance, id);
        }
    }
}

impl Drop for Booking<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.router.release(self.instance, id);
        }
    }
}

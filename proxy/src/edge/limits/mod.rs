//! Limits on what clients send and how much of a model they use at once:
//! request-head size and field count, slow clients, and per-model
//! concurrency with a bounded queue.

#[cfg(test)]
mod fuzz;
mod head;
mod model_slots;

pub(crate) use head::{
    HeadRead, SHUTDOWN_GRACE, answer_raw, answer_unread_head, check_head, check_head_size,
    malformed_head_error, read_head,
};
pub(crate) use model_slots::ConcurrencyLimits;

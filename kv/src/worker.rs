//! Identity of a worker in the index: an engine instance and one of its data-parallel ranks.

/// A (worker instance, data-parallel rank) pair: the unit that holds KV blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerKey {
    /// The engine instance's id (discovery instance id).
    pub instance_id: u64,
    /// The data-parallel rank inside the instance (0 when the engine has one rank).
    pub dp_rank: u32,
}

impl WorkerKey {
    /// The key of rank `dp_rank` of instance `instance_id`.
    pub fn new(instance_id: u64, dp_rank: u32) -> Self {
        Self {
            instance_id,
            dp_rank,
        }
    }
}

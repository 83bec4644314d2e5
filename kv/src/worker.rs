//! Identity of a worker in the index: an engine instance, one of its data-parallel ranks, and
//! the cache tier (device memory, or host memory or disk it loads blocks back from).

/// Where a worker keeps cached blocks. A prefix in a lower tier is loaded back into device
/// memory instead of being computed again: cheaper than a miss, dearer than a device hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum CacheTier {
    /// The engine's device (GPU) KV cache.
    #[default]
    Device,
    /// Host (CPU) memory, e.g. vLLM's offloading connector with `medium` `CPU`.
    Host,
    /// Local or remote disk, or any slower medium.
    Disk,
}

impl CacheTier {
    /// Every tier, fastest first.
    pub const ALL: [Self; 3] = [Self::Device, Self::Host, Self::Disk];

    /// The tier's name on the wire and in metrics: `device`, `host`, `disk`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Device => "device",
            Self::Host => "host",
            Self::Disk => "disk",
        }
    }

    /// The tier named `name` (as [`CacheTier::as_str`] writes it).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|tier| tier.as_str() == name)
    }
}

/// A (worker instance, data-parallel rank, cache tier): the unit that holds KV blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerKey {
    /// The engine instance's id (discovery instance id).
    pub instance_id: u64,
    /// The data-parallel rank inside the instance (0 when the engine has one rank).
    pub dp_rank: u32,
    /// Where the blocks are kept.
    pub tier: CacheTier,
}

impl WorkerKey {
    /// The device cache of rank `dp_rank` of instance `instance_id`.
    pub const fn new(instance_id: u64, dp_rank: u32) -> Self {
        Self {
            instance_id,
            dp_rank,
            tier: CacheTier::Device,
        }
    }

    /// The same rank's cache in `tier`.
    pub fn in_tier(self, tier: CacheTier) -> Self {
        Self { tier, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_read_back_by_name_and_sort_after_their_rank() {
        for tier in CacheTier::ALL {
            assert_eq!(CacheTier::from_name(tier.as_str()), Some(tier));
        }
        assert_eq!(CacheTier::from_name("gpu"), None);
        let device = WorkerKey::new(1, 0);
        assert!(device < device.in_tier(CacheTier::Host));
        assert!(device.in_tier(CacheTier::Disk) < WorkerKey::new(1, 1));
    }
}

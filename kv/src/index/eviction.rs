//! The configured bound on the index's size, and eviction past it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::KvIndex;
use super::worker_blocks::WorkerSlot;
use crate::worker::WorkerKey;

/// Limits on what a [`KvIndex`] holds ([`KvIndex::with_limits`]). The default has none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexLimits {
    /// Most (worker, block) pairs the index holds ([`IndexStats::worker_blocks`]), or `None`
    /// for no bound. Pairs, not distinct blocks: a bounded index keeps 8–16 bytes of store
    /// order per pair beside the ≈ 31–35 bytes per block, a pair is what
    /// eviction drops and what a worker's capacity counts, and bounding pairs bounds distinct
    /// blocks too. Past the bound, each Stored event evicts up to [`EVICTION_FACTOR`] times the
    /// blocks it stored.
    ///
    /// [`IndexStats::worker_blocks`]: super::IndexStats::worker_blocks
    pub max_blocks: Option<u64>,
}

/// Past the bound, a Stored event of `n` blocks evicts at most this many times `n` pairs (and
/// examines at most twice that many store-order entries), so one `apply` does bounded work and
/// the index returns under its bound while it keeps receiving events.
pub const EVICTION_FACTOR: u64 = 2;

impl KvIndex {
    /// An empty index with [`super::DEFAULT_SHARDS`] shards and the given limits.
    pub fn with_limits(limits: IndexLimits) -> Self {
        let mut index = Self::new();
        index.limits = limits;
        index
    }

    /// The index's limits.
    pub fn limits(&self) -> IndexLimits {
        self.limits
    }

    /// Records `worker`'s KV capacity in blocks, as its engine reports it (registers the worker
    /// if needed). A worker holding more blocks than its capacity is lagging or misreporting its
    /// events: past the index's bound, such workers lose blocks first. Without a bound the
    /// capacity changes nothing.
    pub fn set_worker_capacity(&self, worker: WorkerKey, blocks: u64) {
        self.slot_or_register(worker)
            .capacity
            .store(blocks, Ordering::Relaxed);
    }

    /// A tick of the eviction clock.
    pub(super) fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Evicts pairs while the index is past its bound, at most `EVICTION_FACTOR * stored` of
    /// them. Called without any worker lock held.
    pub(super) fn enforce_bound(&self, stored: u64) {
        let Some(max) = self.limits.max_blocks else {
            return;
        };
        let mut budget = EVICTION_FACTOR * stored;
        let mut work = 2 * budget;
        while budget > 0 && work > 0 {
            let over = self.pairs.load(Ordering::Acquire).saturating_sub(max);
            if over == 0 {
                return;
            }
            let Some((victim, wanted)) = self.victim() else {
                return;
            };
            let evicted = {
                let mut state = victim.lock();
                if state.retired {
                    work -= 1;
                    continue;
                }
                let wanted = wanted.unwrap_or(over).min(over).min(budget);
                state.evict(&self.table, &victim, wanted, &mut work)
            };
            self.pairs.fetch_sub(evicted, Ordering::AcqRel);
            self.evicted.fetch_add(evicted, Ordering::Relaxed);
            budget = budget.saturating_sub(evicted);
            if evicted == 0 {
                return;
            }
        }
    }

    /// The worker to evict from: the one furthest over its capacity (with its excess), else
    /// the least recently used one holding blocks.
    fn victim(&self) -> Option<(Arc<WorkerSlot>, Option<u64>)> {
        let registry = self.registry();
        let slots = || registry.by_key.values();
        if let Some(slot) = slots().max_by_key(|slot| slot.excess())
            && slot.excess() > 0
        {
            return Some((Arc::clone(slot), Some(slot.excess())));
        }
        slots()
            .filter(|slot| slot.counters.cached_blocks.load(Ordering::Acquire) > 0)
            .min_by_key(|slot| (slot.last_used.load(Ordering::Relaxed), slot.key))
            .map(|slot| (Arc::clone(slot), None))
    }
}

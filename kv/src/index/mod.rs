//! The KV overlap index: which worker holds which blocks, and how deep a request matches each.
//!
//! See the crate documentation for the data layout, the concurrency design and measurements.

mod block_table;
mod eviction;
mod key_mixer;
mod key_order;
mod matcher;
mod node_refs;
mod ordered_table;
mod slot_bits;
mod slot_set;
mod store_order;
mod worker_blocks;

pub use eviction::{EVICTION_FACTOR, IndexLimits};

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::event::KvEvent;
use crate::hash::SequenceHash;
use crate::keyed_hasher::KeyedState;
use crate::outcome::ApplyOutcome;
use crate::scores::{OverlapScores, WorkerOverlap};
use crate::worker::WorkerKey;

use block_table::BlockTable;
use key_order::{KeyOrder, OrderScratch};
use matcher::{MatchScratch, linear_depth, prefix_depths};
use worker_blocks::WorkerSlot;

/// Default number of block-table shards.
pub const DEFAULT_SHARDS: usize = 1024;

/// A lookup's reusable buffers.
#[derive(Debug, Default)]
struct LookupScratch {
    matching: MatchScratch,
    /// (slot, depth) of the workers holding the query's first block.
    depths: Vec<(u32, u32)>,
    order: OrderScratch,
}

thread_local! {
    static SCRATCH: RefCell<LookupScratch> = RefCell::default();
}

/// Registered workers by key and by slot.
#[derive(Debug, Default)]
struct Registry {
    by_key: HashMap<WorkerKey, Arc<WorkerSlot>, KeyedState>,
    slots: Vec<Option<Arc<WorkerSlot>>>,
    free: Vec<u32>,
    order: KeyOrder,
}

/// A worker's slots taken out of the index by [`KvIndex::detach_worker`], whose blocks
/// [`KvIndex::release_detached`] frees.
#[must_use = "a detached worker's blocks stay in the block table until released"]
#[derive(Debug, Default)]
pub struct DetachedWorker {
    slots: Vec<Arc<WorkerSlot>>,
}

impl DetachedWorker {
    /// Whether it holds no slot (the instance was not registered): nothing to release.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// Totals over the whole index, for gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Registered workers (worker keys).
    pub workers: usize,
    /// Distinct blocks held by at least one worker.
    pub distinct_blocks: usize,
    /// Sum over workers of the blocks each holds.
    pub worker_blocks: u64,
    /// Sum over workers of held blocks whose parent that worker does not hold.
    pub orphan_blocks: u64,
    /// (worker, block) pairs evicted to keep under [`IndexLimits::max_blocks`] since the
    /// index was created (a counter).
    pub evicted_blocks: u64,
}

/// The KV overlap index over all workers. Safe to share between threads (`Arc<KvIndex>`).
///
/// Writers ([`KvIndex::apply`]) for different workers run in parallel; writers for one worker
/// serialise, and must apply that worker's events in order. Lookups
/// ([`KvIndex::find_matches`]) take only short per-shard read locks and never wait for a whole
/// event. A lookup running while events are applied sees each block as of some moment during
/// the lookup, so it may mix the states before and after an event; with no concurrent write it
/// is exact.
#[derive(Debug)]
pub struct KvIndex {
    table: BlockTable,
    registry: RwLock<Registry>,
    limits: IndexLimits,
    /// (worker, block) pairs held: the sum of the workers' `cached_blocks`.
    pairs: AtomicU64,
    /// Pairs evicted so far.
    evicted: AtomicU64,
    /// Eviction clock: ticks once per Stored event.
    clock: AtomicU64,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl KvIndex {
    /// An empty index with [`DEFAULT_SHARDS`] shards.
    pub fn new() -> Self {
        Self::with_shards(DEFAULT_SHARDS)
    }

    /// An empty index whose block table has `shards` shards (rounded up to a power of two).
    /// One shard is a single reader-writer lock over the table.
    pub fn with_shards(shards: usize) -> Self {
        Self {
            table: BlockTable::new(shards),
            registry: RwLock::default(),
            limits: IndexLimits::default(),
            pairs: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            clock: AtomicU64::new(0),
        }
    }

    /// Number of block-table shards.
    pub fn shard_count(&self) -> usize {
        self.table.shard_count()
    }

    fn registry(&self) -> RwLockReadGuard<'_, Registry> {
        self.registry.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn registry_mut(&self) -> RwLockWriteGuard<'_, Registry> {
        self.registry
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn slot(&self, worker: WorkerKey) -> Option<Arc<WorkerSlot>> {
        self.registry().by_key.get(&worker).cloned()
    }

    fn slot_or_register(&self, worker: WorkerKey) -> Arc<WorkerSlot> {
        if let Some(slot) = self.slot(worker) {
            return slot;
        }
        let mut registry = self.registry_mut();
        if let Some(slot) = registry.by_key.get(&worker) {
            return Arc::clone(slot);
        }
        let number = registry.free.pop().unwrap_or_else(|| {
            registry.slots.push(None);
            // Slots are dense; 2^31 registered workers (the block table's
            // holder tag bit) is not a supported state.
            (registry.slots.len() - 1) as u32
        });
        let ordered = self.limits.max_blocks.is_some();
        let slot = Arc::new(WorkerSlot::new(worker, number, ordered));
        registry.slots[number as usize] = Some(Arc::clone(&slot));
        registry.by_key.insert(worker, Arc::clone(&slot));
        registry.order.insert(worker, number);
        slot
    }

    /// Applies one event of `worker`. Never fails: problems are counted in the outcome.
    ///
    /// - Stored: each block is attached to `worker` by its sequence hash after checking that it
    ///   chains from the previous one (`sequence_hash(previous, local) == sequence`); the first
    ///   block that does not is rejected with the rest of the chain (`blocks_invalid`). An
    ///   unknown parent does not stop the event: the blocks are attached anyway (orphans until
    ///   the parent is stored) and `parent_not_found` counts the event. Storing an engine id
    ///   again under another sequence hash moves it. Registers `worker` on first sight.
    /// - Removed: drops each named block from `worker` only (no cascade to descendants); unknown
    ///   ids count as `blocks_not_found`.
    /// - Cleared: drops every block of every data-parallel rank of `worker.instance_id`; the
    ///   ranks stay registered.
    pub fn apply(&self, worker: WorkerKey, event: &KvEvent) -> ApplyOutcome {
        match event {
            KvEvent::Stored { parent, blocks } => {
                let outcome = loop {
                    let slot = self.slot_or_register(worker);
                    let mut state = slot.lock();
                    if state.retired {
                        continue;
                    }
                    let before = slot.counters.cached_blocks.load(Ordering::Acquire);
                    let outcome = state.store(&self.table, &slot, *parent, blocks);
                    self.count_pairs(before, &slot);
                    if self.limits.max_blocks.is_some() {
                        slot.last_used.store(self.tick(), Ordering::Relaxed);
                    }
                    break outcome;
                };
                self.enforce_bound(outcome.blocks_stored);
                outcome
            }
            KvEvent::Removed { blocks } => {
                let not_found = ApplyOutcome {
                    blocks_not_found: blocks.len() as u64,
                    ..ApplyOutcome::default()
                };
                let Some(slot) = self.slot(worker) else {
                    return not_found;
                };
                let mut state = slot.lock();
                if state.retired {
                    return not_found;
                }
                let before = slot.counters.cached_blocks.load(Ordering::Acquire);
                let outcome = state.remove(&self.table, &slot, blocks);
                self.count_pairs(before, &slot);
                outcome
            }
            KvEvent::Cleared => self.clear_instance(worker.instance_id),
        }
    }

    /// Adds the change of `slot`'s held blocks since `before` to the index's pair count (under
    /// the worker's lock, so no other writer changed them).
    fn count_pairs(&self, before: u64, slot: &WorkerSlot) {
        let after = slot.counters.cached_blocks.load(Ordering::Acquire);
        if after >= before {
            self.pairs.fetch_add(after - before, Ordering::AcqRel);
        } else {
            self.pairs.fetch_sub(before - after, Ordering::AcqRel);
        }
    }

    fn instance_slots(&self, instance_id: u64) -> Vec<Arc<WorkerSlot>> {
        self.registry()
            .by_key
            .values()
            .filter(|slot| slot.key.instance_id == instance_id)
            .cloned()
            .collect()
    }

    fn clear_instance(&self, instance_id: u64) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        for slot in self.instance_slots(instance_id) {
            let mut state = slot.lock();
            if !state.retired {
                let cleared = state.clear(&self.table, &slot);
                self.pairs.fetch_sub(cleared, Ordering::AcqRel);
                outcome.blocks_cleared += cleared;
            }
        }
        outcome
    }

    /// Forgets every data-parallel rank of worker instance `instance_id` (discovery removal):
    /// [`detach_worker`](Self::detach_worker), then
    /// [`release_detached`](Self::release_detached).
    pub fn remove_worker(&self, instance_id: u64) -> ApplyOutcome {
        let detached = self.detach_worker(instance_id);
        self.release_detached(detached)
    }

    /// Forgets one worker key and all its blocks; its slot is reused later.
    pub fn remove_worker_dp_rank(&self, worker: WorkerKey) -> ApplyOutcome {
        let detached = DetachedWorker {
            slots: self.detach_slot(worker).into_iter().collect(),
        };
        self.release_detached(detached)
    }

    /// Takes every data-parallel rank of worker instance `instance_id` out of the index at
    /// once: from now on lookups do not see its blocks, the totals do not count them, and its
    /// events register it anew. Its blocks stay in the block table until
    /// [`release_detached`](Self::release_detached) frees them, which scans every shard (about
    /// 5 ms per million blocks in the index): the caller runs that where a long call blocks
    /// nothing else.
    pub fn detach_worker(&self, instance_id: u64) -> DetachedWorker {
        let slots = self
            .instance_slots(instance_id)
            .into_iter()
            .filter_map(|slot| self.detach_slot(slot.key))
            .collect();
        DetachedWorker { slots }
    }

    /// Frees the blocks of a worker [`detach_worker`](Self::detach_worker) took out; its
    /// slots are reused after. Returns the blocks it held.
    pub fn release_detached(&self, detached: DetachedWorker) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        for slot in detached.slots {
            outcome.blocks_cleared += slot.lock().clear(&self.table, &slot);
            self.registry_mut().free.push(slot.slot);
        }
        outcome
    }

    /// Unregisters worker key `worker` and retires its slot (its pairs leave the count);
    /// `None` when it was not registered.
    fn detach_slot(&self, worker: WorkerKey) -> Option<Arc<WorkerSlot>> {
        let slot = {
            let mut registry = self.registry_mut();
            let slot = registry.by_key.remove(&worker)?;
            registry.slots[slot.slot as usize] = None;
            registry.order.remove(slot.slot);
            slot
        };
        let mut state = slot.lock();
        state.retired = true;
        // Under the worker's lock: no writer changes its count after this.
        let held = slot.counters.cached_blocks.load(Ordering::Acquire);
        self.pairs.fetch_sub(held, Ordering::AcqRel);
        drop(state);
        Some(slot)
    }

    /// How many leading blocks of `query` (a request's sequence hashes, in order) each worker
    /// holds. A worker's depth is the length of the longest prefix whose every block it holds,
    /// so a block held without its parent never counts. Blocks past `u32::MAX` are ignored.
    pub fn find_matches(&self, query: &[SequenceHash]) -> OverlapScores {
        let query = &query[..query.len().min(u32::MAX as usize)];
        SCRATCH.with(|scratch| {
            let scratch = &mut *scratch.borrow_mut();
            scratch.depths.clear();
            prefix_depths(
                &self.table,
                query,
                &mut scratch.matching,
                &mut scratch.depths,
            );
            self.resolve(query, scratch)
        })
    }

    /// Maps slots to workers, re-checking depths of workers that hold orphans, in key order.
    fn resolve(&self, query: &[SequenceHash], scratch: &mut LookupScratch) -> OverlapScores {
        let registry = self.registry();
        let now = self
            .limits
            .max_blocks
            .map(|_| self.clock.load(Ordering::Relaxed));
        registry.order.sort(&mut scratch.depths, &mut scratch.order);
        let mut workers = Vec::with_capacity(scratch.depths.len());
        for &(slot, depth) in &scratch.depths {
            let Some(Some(worker)) = registry.slots.get(slot as usize) else {
                continue;
            };
            let depth = if worker.counters.orphans.load(Ordering::Acquire) > 0 {
                linear_depth(&self.table, query, slot)
            } else {
                depth
            };
            if depth > 0 {
                // Written only when the clock moved, so that lookups on several cores do not
                // keep taking the worker's cache line from one another.
                if let Some(now) = now
                    && worker.last_used.load(Ordering::Relaxed) != now
                {
                    worker.last_used.store(now, Ordering::Relaxed);
                }
                workers.push(WorkerOverlap {
                    worker: worker.key,
                    depth,
                    cached_blocks: worker.counters.cached_blocks.load(Ordering::Acquire),
                });
            }
        }
        OverlapScores { workers }
    }

    /// Every registered worker with its number of distinct cached blocks, sorted by key.
    pub fn cached_blocks(&self) -> Vec<(WorkerKey, u64)> {
        let mut all: Vec<(WorkerKey, u64)> = self
            .registry()
            .by_key
            .values()
            .map(|slot| {
                (
                    slot.key,
                    slot.counters.cached_blocks.load(Ordering::Acquire),
                )
            })
            .collect();
        all.sort_unstable_by_key(|&(key, _)| key);
        all
    }

    /// Registered worker keys, sorted.
    pub fn workers(&self) -> Vec<WorkerKey> {
        let mut keys: Vec<WorkerKey> = self.registry().by_key.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// Heap bytes the index holds: its tables' allocations (capacity, not only what is
    /// used), the workers' bookkeeping and the registry. Walks every shard and every worker,
    /// locking each briefly: for gauges, not for the request path.
    pub fn heap_bytes(&self) -> usize {
        let (workers, registry_bytes) = {
            let registry = self.registry();
            let workers: Vec<Arc<WorkerSlot>> = registry.by_key.values().cloned().collect();
            let bytes = hash_map_bytes::<WorkerKey, Arc<WorkerSlot>>(registry.by_key.capacity())
                + registry.slots.capacity() * std::mem::size_of::<Option<Arc<WorkerSlot>>>()
                + registry.free.capacity() * std::mem::size_of::<u32>()
                + registry.order.heap_bytes();
            (workers, bytes)
        };
        // An `Arc`'s allocation: two counts and the slot.
        let per_worker = 2 * std::mem::size_of::<usize>() + std::mem::size_of::<WorkerSlot>();
        let worker_bytes: usize = workers
            .iter()
            .map(|worker| per_worker + worker.lock().heap_bytes())
            .sum();
        self.table.heap_bytes() + registry_bytes + worker_bytes
    }

    /// Totals for gauges (walks every shard: not for the request path).
    pub fn stats(&self) -> IndexStats {
        let (workers, worker_blocks, orphan_blocks) = {
            let registry = self.registry();
            let (blocks, orphans) = registry.by_key.values().fold((0, 0), |(b, o), slot| {
                (
                    b + slot.counters.cached_blocks.load(Ordering::Acquire),
                    o + slot.counters.orphans.load(Ordering::Acquire),
                )
            });
            (registry.by_key.len(), blocks, orphans)
        };
        IndexStats {
            workers,
            distinct_blocks: self.table.len(),
            worker_blocks,
            orphan_blocks,
            evicted_blocks: self.evicted.load(Ordering::Relaxed),
        }
    }
}

/// Heap bytes of a `HashMap<K, V>` of `capacity`, estimated: an entry and one control byte
/// per bucket.
fn hash_map_bytes<K, V>(capacity: usize) -> usize {
    capacity * (std::mem::size_of::<(K, V)>() + 1)
}

#[cfg(test)]
mod tests;

//! One worker's view of its blocks: engine ids, reference counts and orphan accounting.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::event::{BlockParent, StoredBlock};
use crate::hash::{ExternalHash, sequence_hash};
use crate::outcome::ApplyOutcome;
use crate::worker::WorkerKey;

use super::block_table::BlockTable;
use super::ordered_table::{OrderedTable, join, split};
use super::store_order::StoreOrder;

/// A registered worker: its dense slot number, counters lookups read without locking, and the
/// bookkeeping that writers for this worker serialise on.
#[derive(Debug)]
pub(crate) struct WorkerSlot {
    /// The worker's key.
    pub(crate) key: WorkerKey,
    /// Dense slot number, the worker's id inside the block table.
    pub(crate) slot: u32,
    /// Counters published for lookups.
    pub(crate) counters: WorkerCounters,
    /// The worker's KV capacity in blocks as its engine reports it (`u64::MAX`: unknown).
    pub(crate) capacity: AtomicU64,
    /// The index's eviction clock when the worker last stored a block or matched a lookup.
    pub(crate) last_used: AtomicU64,
    blocks: Mutex<WorkerBlocks>,
}

impl WorkerSlot {
    /// A fresh, empty worker in slot `slot`; `ordered` keeps its store order for eviction.
    pub(crate) fn new(key: WorkerKey, slot: u32, ordered: bool) -> Self {
        Self {
            key,
            slot,
            counters: WorkerCounters::default(),
            capacity: AtomicU64::new(u64::MAX),
            last_used: AtomicU64::new(0),
            blocks: Mutex::new(WorkerBlocks {
                order: ordered.then(StoreOrder::default),
                ..WorkerBlocks::default()
            }),
        }
    }

    /// Blocks held beyond the worker's reported capacity.
    pub(crate) fn excess(&self) -> u64 {
        let held = self.counters.cached_blocks.load(Ordering::Acquire);
        held.saturating_sub(self.capacity.load(Ordering::Relaxed))
    }

    /// Locks the worker's bookkeeping (held for one event).
    pub(crate) fn lock(&self) -> MutexGuard<'_, WorkerBlocks> {
        self.blocks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Per-worker numbers that lookups read without taking the worker's lock.
#[derive(Debug, Default)]
pub(crate) struct WorkerCounters {
    /// Distinct blocks the worker holds.
    pub(crate) cached_blocks: AtomicU64,
    /// Held blocks whose parent the worker does not hold. While zero, the worker's blocks are
    /// prefix-closed and lookups may binary-search its match depth.
    pub(crate) orphans: AtomicU64,
}

impl WorkerCounters {
    fn add_orphans(&self, n: u32) {
        if n > 0 {
            self.orphans.fetch_add(u64::from(n), Ordering::Release);
        }
    }

    fn sub_orphans(&self, n: u32) {
        if n > 0 {
            self.orphans.fetch_sub(u64::from(n), Ordering::Release);
        }
    }
}

/// Reference counts of one block in one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct NodeRefs {
    /// Engine ids of this worker that map to the block, its own id included; held while
    /// non-zero.
    refs: u32,
    /// Held blocks of this worker whose parent is this block.
    children: u32,
    /// Whether the block's own id maps to it: the engine id equal to its sequence hash, which
    /// is how the worker-agent names blocks. That id has no entry in
    /// [`WorkerBlocks::external`]; this flag is its entry.
    own: bool,
}

/// [`NodeRefs`] as stored (a 12-byte table slot with its key): `refs` holds the count in its
/// low 15 bits and [`NodeRefs::own`] in its top bit; `children` is the count. Counts that do
/// not fit are kept in [`WorkerBlocks::wide`] and stored here as [`WIDE`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct PackedRefs {
    refs: u16,
    children: u16,
}

/// The bit of [`PackedRefs::refs`] that holds [`NodeRefs::own`].
const OWN: u16 = 1 << 15;

impl PackedRefs {
    /// `node` packed, or `None` when its counts do not fit.
    fn pack(node: NodeRefs) -> Option<Self> {
        let refs = u16::try_from(node.refs).ok().filter(|&r| r < OWN)?;
        let children = u16::try_from(node.children).ok()?;
        let packed = Self {
            refs: refs | if node.own { OWN } else { 0 },
            children,
        };
        (packed != WIDE).then_some(packed)
    }

    /// The counts this packs (not for [`WIDE`]).
    fn unpack(self) -> NodeRefs {
        NodeRefs {
            refs: u32::from(self.refs & !OWN),
            children: u32::from(self.children),
            own: self.refs & OWN != 0,
        }
    }
}

/// The packed form of counts kept in [`WorkerBlocks::wide`].
const WIDE: PackedRefs = PackedRefs {
    refs: u16::MAX,
    children: u16::MAX,
};

/// One worker's blocks. Every method runs under the worker's lock.
///
/// Keys are mixed ([`super::key_mixer::KeyMixer`], the block table's): engine ids and sequence
/// hashes alike. The mixer is a bijection, so an engine id equal to a block's sequence hash
/// has that block's key.
#[derive(Debug, Default)]
pub(crate) struct WorkerBlocks {
    /// Engine id key → block key, to resolve removals and parents, for ids other than their
    /// block's own ([`NodeRefs::own`]).
    external: OrderedTable<[u32; 2]>,
    /// Block key → counts, for held blocks and for unheld parents of held blocks (a node
    /// exists exactly while one of its counts is non-zero).
    nodes: OrderedTable<PackedRefs>,
    /// Counts of the nodes stored as [`WIDE`] (a block with 65,535 engine ids or children).
    wide: HashMap<u64, NodeRefs>,
    /// Engine ids in store order, when the index has a bound and may evict.
    order: Option<StoreOrder>,
    /// Set when the worker was removed from the index; later writers must re-register.
    pub(crate) retired: bool,
}

impl WorkerBlocks {
    /// Heap bytes of the worker's tables.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.external.heap_bytes()
            + self.nodes.heap_bytes()
            + super::hash_map_bytes::<u64, NodeRefs>(self.wide.capacity())
            + self.order.as_ref().map_or(0, StoreOrder::heap_bytes)
    }

    /// Applies a Stored event.
    pub(crate) fn store(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        parent: Option<BlockParent>,
        blocks: &[StoredBlock],
    ) -> ApplyOutcome {
        let mixer = *table.mixer();
        let mut outcome = ApplyOutcome::default();
        let mark = self.order.as_ref().map(StoreOrder::mark);
        if let Some(parent) = parent
            && self.target(mixer.mix(parent.external.0)) != Some(mixer.mix(parent.sequence.0))
        {
            outcome.parent_not_found += 1;
        }
        let mut previous = parent.map(|p| p.sequence);
        let mut previous_key = previous.map(|p| mixer.mix(p.0));
        for (index, block) in blocks.iter().enumerate() {
            let key = mixer.mix(block.sequence.0);
            let valid = sequence_hash(previous, block.local) == block.sequence
                && previous != Some(block.sequence)
                && self.map_external(table, slot, mixer.mix(block.external.0), key, previous_key);
            if !valid {
                outcome.blocks_invalid += (blocks.len() - index) as u64;
                break;
            }
            outcome.blocks_stored += 1;
            previous = Some(block.sequence);
            previous_key = Some(key);
        }
        if let (Some(mut order), Some(mark)) = (self.order.take(), mark) {
            order.reverse_since(mark);
            let work = 2 * blocks.len() + 8;
            // Own ids are at most the held blocks: a bound on the ids mapped.
            let live =
                self.external.len() as u64 + slot.counters.cached_blocks.load(Ordering::Relaxed);
            order.compact(live as usize, work, |entry| self.target(entry).is_some());
            self.order = Some(order);
        }
        outcome
    }

    /// Evicts this worker's oldest-stored blocks (an event's deepest first) until `pairs` blocks are gone or `work` queue
    /// entries were examined (decremented per entry); returns the number of blocks evicted. An
    /// engine id is dropped as a Removed event would drop it; a block goes when its last engine
    /// id goes. Tables left at most a quarter full are rebuilt smaller (work proportional to
    /// the table, amortised over the three quarters of it evicted before).
    pub(crate) fn evict(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        pairs: u64,
        work: &mut u64,
    ) -> u64 {
        let Some(mut order) = self.order.take() else {
            return 0;
        };
        let held = |slot: &WorkerSlot| slot.counters.cached_blocks.load(Ordering::Acquire);
        let before = held(slot);
        while *work > 0 && before - held(slot) < pairs {
            *work -= 1;
            let Some(external) = order.pop() else {
                break;
            };
            self.drop_id(table, slot, external);
        }
        // A worker emptied by eviction keeps little memory, so the bound on pairs bounds the
        // sum of the workers' tables, not only the sum of what they hold.
        self.external.shrink();
        self.nodes.shrink();
        order.shrink();
        self.order = Some(order);
        before - held(slot)
    }

    /// Applies a Removed event.
    pub(crate) fn remove(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        blocks: &[ExternalHash],
    ) -> ApplyOutcome {
        let mixer = *table.mixer();
        let mut outcome = ApplyOutcome::default();
        for external in blocks {
            if self.drop_id(table, slot, mixer.mix(external.0)) {
                outcome.blocks_removed += 1;
            } else {
                outcome.blocks_not_found += 1;
            }
        }
        outcome
    }

    /// The block key engine id key `external` maps to.
    fn target(&self, external: u64) -> Option<u64> {
        match self.external.get(external) {
            Some(&key) => Some(join(key)),
            None => self.node(external).own.then_some(external),
        }
    }

    /// Unmaps engine id key `external`, releasing its block; false when it was not mapped.
    fn drop_id(&mut self, table: &BlockTable, slot: &WorkerSlot, external: u64) -> bool {
        if let Some(key) = self.external.remove(external) {
            self.release(table, slot, join(key), false);
            true
        } else if self.node(external).own {
            self.release(table, slot, external, true);
            true
        } else {
            false
        }
    }

    /// Drops every block of the worker; returns how many distinct blocks it held.
    pub(crate) fn clear(&mut self, table: &BlockTable, slot: &WorkerSlot) -> u64 {
        let mut cleared = 0;
        for (key, &packed) in self.nodes.iter() {
            if self.counts(key, packed).refs > 0 {
                table.remove_holder(key, slot.slot);
                cleared += 1;
            }
        }
        self.nodes.clear();
        self.wide.clear();
        self.external.clear();
        if let Some(order) = &mut self.order {
            order.clear();
        }
        slot.counters.cached_blocks.store(0, Ordering::Release);
        slot.counters.orphans.store(0, Ordering::Release);
        cleared
    }

    /// Points engine id key `external` at block key `key`, holding it; false on a parent
    /// mismatch. An id equal to its block's key is kept as the node's own id, not in
    /// `external`.
    fn map_external(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        external: u64,
        key: u64,
        parent: Option<u64>,
    ) -> bool {
        let old = self.target(external);
        if old == Some(key) {
            return true;
        }
        let own = external == key;
        if !self.acquire(table, slot, key, parent, own) {
            return false;
        }
        match old {
            // The id moves from its own block to another.
            Some(old) if old == external => self.release(table, slot, old, true),
            Some(old) => {
                if own {
                    self.external.remove(external);
                }
                self.release(table, slot, old, false);
            }
            None => {}
        }
        if !own {
            self.external.insert(external, split(key));
        }
        if let Some(order) = &mut self.order {
            order.push(external);
        }
        true
    }

    /// The counts of `key` (zero when it has no node).
    fn node(&self, key: u64) -> NodeRefs {
        self.nodes
            .get(key)
            .map_or_else(NodeRefs::default, |&packed| self.counts(key, packed))
    }

    /// The counts of node `key`, stored as `packed`.
    fn counts(&self, key: u64, packed: PackedRefs) -> NodeRefs {
        if packed == WIDE {
            self.wide.get(&key).copied().unwrap_or_default()
        } else {
            packed.unpack()
        }
    }

    /// Sets the counts of `key`, dropping its node when both are zero.
    fn set_node(&mut self, key: u64, node: NodeRefs) {
        let packed = if node == NodeRefs::default() {
            None
        } else {
            match PackedRefs::pack(node) {
                Some(packed) => Some(packed),
                None => {
                    self.wide.insert(key, node);
                    Some(WIDE)
                }
            }
        };
        let old = match packed {
            None => self.nodes.remove(key),
            Some(packed) => self.nodes.insert(key, packed),
        };
        if old == Some(WIDE) && packed != Some(WIDE) {
            self.wide.remove(&key);
        }
    }

    /// Adds one reference to `key`, its own id's when `own`; false (and nothing changed) on a
    /// parent mismatch.
    fn acquire(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        key: u64,
        parent: Option<u64>,
        own: bool,
    ) -> bool {
        let node = self.node(key);
        if node.refs > 0 {
            self.set_node(
                key,
                NodeRefs {
                    refs: node.refs + 1,
                    children: node.children,
                    own: node.own || own,
                },
            );
            return true;
        }
        // Orphan counts rise before the block becomes visible, and fall after.
        let orphan = match parent {
            Some(parent) => {
                let parent_node = self.node(parent);
                self.set_node(
                    parent,
                    NodeRefs {
                        children: parent_node.children + 1,
                        ..parent_node
                    },
                );
                parent_node.refs == 0
            }
            None => false,
        };
        if orphan {
            slot.counters.add_orphans(1);
        }
        if table.add_holder(key, parent, slot.slot).is_err() {
            if orphan {
                slot.counters.sub_orphans(1);
            }
            if let Some(parent) = parent {
                self.forget_child(parent);
            }
            return false;
        }
        // `key` is not its own parent (rejected earlier), so its children are unchanged.
        self.set_node(
            key,
            NodeRefs {
                refs: 1,
                children: node.children,
                own,
            },
        );
        slot.counters.sub_orphans(node.children);
        slot.counters.cached_blocks.fetch_add(1, Ordering::Release);
        true
    }

    /// Undoes one `children` count of `parent`.
    fn forget_child(&mut self, parent: u64) {
        let node = self.node(parent);
        self.set_node(
            parent,
            NodeRefs {
                children: node.children.saturating_sub(1),
                ..node
            },
        );
    }

    /// Drops one reference to `key`, its own id's when `own`, releasing the block when none
    /// is left.
    fn release(&mut self, table: &BlockTable, slot: &WorkerSlot, key: u64, own: bool) {
        let node = self.node(key);
        if node.refs == 0 {
            return;
        }
        self.set_node(
            key,
            NodeRefs {
                refs: node.refs - 1,
                children: node.children,
                own: node.own && !own,
            },
        );
        if node.refs > 1 {
            return;
        }
        // Held children become orphans before the block disappears from lookups.
        slot.counters.add_orphans(node.children);
        let parent = table.remove_holder(key, slot.slot).flatten();
        slot.counters.cached_blocks.fetch_sub(1, Ordering::Release);
        let Some(parent) = parent else {
            return;
        };
        let parent_node = self.node(parent);
        if parent_node.children == 0 {
            return;
        }
        self.forget_child(parent);
        if parent_node.refs == 0 {
            slot.counters.sub_orphans(1);
        }
    }
}

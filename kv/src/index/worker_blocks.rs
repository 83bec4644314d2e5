//! One worker's view of its blocks: engine ids, reference counts and orphan accounting.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::event::{BlockParent, StoredBlock};
use crate::hash::{ExternalHash, sequence_hash};
use crate::outcome::ApplyOutcome;
use crate::worker::WorkerKey;

use super::block_table::BlockTable;
use super::node_refs::{NodeRefs, PackedRefs};
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

/// Where a worker's counts for one block live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// The worker's own tables (or nowhere, for zero counts).
    Table,
    /// The block's slot in the block table: the worker owns the block.
    Owned,
}

/// One worker's blocks. Every method runs under the worker's lock.
///
/// The counts of a block the worker owns ([`BlockTable::add_holder`]) live in the block table;
/// its tables keep the counts of the blocks it holds without owning them, and of unheld
/// parents of held blocks. A block's counts are in exactly one of the two places.
///
/// Keys are mixed ([`super::key_mixer::KeyMixer`], the block table's): engine ids and sequence
/// hashes alike. The mixer is a bijection, so an engine id equal to a block's sequence hash
/// has that block's key.
#[derive(Debug, Default)]
pub(crate) struct WorkerBlocks {
    /// Engine id key → block key, to resolve removals and parents, for ids other than their
    /// block's own ([`NodeRefs::own`]).
    external: OrderedTable<[u32; 2]>,
    /// Block key → counts, for blocks held but not owned and for unheld parents of held
    /// blocks (a node exists exactly while one of its counts is non-zero).
    nodes: OrderedTable<PackedRefs>,
    /// Counts of the nodes stored as [`PackedRefs::WIDE`] (a block with 32,768 engine ids or
    /// 65,535 children).
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
            && self.target(table, slot, mixer.mix(parent.external.0))
                != Some(mixer.mix(parent.sequence.0))
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
            order.compact(live as usize, work, |entry| {
                self.target(table, slot, entry).is_some()
            });
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
    fn target(&self, table: &BlockTable, slot: &WorkerSlot, external: u64) -> Option<u64> {
        match self.external.get(external) {
            Some(&key) => Some(join(key)),
            None => self.node(table, slot, external).0.own.then_some(external),
        }
    }

    /// Unmaps engine id key `external`, releasing its block; false when it was not mapped.
    fn drop_id(&mut self, table: &BlockTable, slot: &WorkerSlot, external: u64) -> bool {
        if let Some(key) = self.external.remove(external) {
            self.release(table, slot, join(key), false);
            true
        } else if self.node(table, slot, external).0.own {
            self.release(table, slot, external, true);
            true
        } else {
            false
        }
    }

    /// Drops every block of the worker; returns how many distinct blocks it held. Visits
    /// every shard of the block table when the worker owns blocks.
    pub(crate) fn clear(&mut self, table: &BlockTable, slot: &WorkerSlot) -> u64 {
        let mut cleared = 0;
        for (key, &packed) in self.nodes.iter() {
            if self.counts(key, packed).refs > 0 {
                table.remove_holder(key, slot.slot);
                cleared += 1;
            }
        }
        if slot.counters.cached_blocks.load(Ordering::Acquire) > cleared {
            cleared += table.remove_owned(slot.slot);
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
        let own = external == key;
        let (node, place) = self.node(table, slot, key);
        let old = match self.external.get(external) {
            Some(&mapped) => Some(join(mapped)),
            None if own => node.own.then_some(key),
            None => self.node(table, slot, external).0.own.then_some(external),
        };
        if old == Some(key) {
            return true;
        }
        if !self.acquire(table, slot, key, parent, own, (node, place)) {
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

    /// The counts of `key` (zero when it has no node), and where they live.
    fn node(&self, table: &BlockTable, slot: &WorkerSlot, key: u64) -> (NodeRefs, Place) {
        if let Some(&packed) = self.nodes.get(key) {
            return (self.counts(key, packed), Place::Table);
        }
        match table.owned(key, slot.slot) {
            Some(packed) => (packed.unpack(), Place::Owned),
            None => (NodeRefs::default(), Place::Table),
        }
    }

    /// The counts of node `key`, stored as `packed`.
    fn counts(&self, key: u64, packed: PackedRefs) -> NodeRefs {
        if packed == PackedRefs::WIDE {
            self.wide.get(&key).copied().unwrap_or_default()
        } else {
            packed.unpack()
        }
    }

    /// Sets the counts of `key`, which live at `place`. An owner's counts that no longer fit
    /// the block's slot give the ownership up and move to the worker's tables.
    fn set_node(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        key: u64,
        node: NodeRefs,
        place: Place,
    ) {
        if place == Place::Owned
            && let Some((_, true)) = table.change_owned(key, slot.slot, |_| node)
        {
            return;
        }
        self.set_table_node(key, node);
    }

    /// Applies `change` to the counts of `key` wherever they live (one block-table lock when
    /// the worker owns the block); returns the counts before.
    fn update(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        key: u64,
        change: impl Fn(NodeRefs) -> NodeRefs,
    ) -> NodeRefs {
        let before = match self.nodes.get(key) {
            Some(&packed) => self.counts(key, packed),
            None => match table.change_owned(key, slot.slot, &change) {
                Some((before, true)) => return before,
                Some((before, false)) => before,
                None => NodeRefs::default(),
            },
        };
        self.set_table_node(key, change(before));
        before
    }

    /// Sets the counts of `key` in the worker's tables, dropping its node when both are zero.
    fn set_table_node(&mut self, key: u64, node: NodeRefs) {
        let packed = if node == NodeRefs::default() {
            None
        } else {
            match PackedRefs::pack(node) {
                Some(packed) => Some(packed),
                None => {
                    self.wide.insert(key, node);
                    Some(PackedRefs::WIDE)
                }
            }
        };
        let old = match packed {
            None => self.nodes.remove(key),
            Some(packed) => self.nodes.insert(key, packed),
        };
        if old == Some(PackedRefs::WIDE) && packed != Some(PackedRefs::WIDE) {
            self.wide.remove(&key);
        }
    }

    /// Adds one reference to `key`, whose counts are `(node, place)`, its own id's when `own`;
    /// false (and nothing changed) on a parent mismatch.
    fn acquire(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        key: u64,
        parent: Option<u64>,
        own: bool,
        (node, place): (NodeRefs, Place),
    ) -> bool {
        if node.refs > 0 {
            let node = NodeRefs {
                refs: node.refs + 1,
                children: node.children,
                own: node.own || own,
            };
            self.set_node(table, slot, key, node, place);
            return true;
        }
        // Orphan counts rise before the block becomes visible, and fall after.
        let orphan = parent.is_some_and(|parent| {
            let counted = |node: NodeRefs| NodeRefs {
                children: node.children + 1,
                ..node
            };
            self.update(table, slot, parent, counted).refs == 0
        });
        if orphan {
            slot.counters.add_orphans(1);
        }
        // `key` is not its own parent (rejected earlier), so its children are unchanged.
        let held = NodeRefs {
            refs: 1,
            children: node.children,
            own,
        };
        let offered = PackedRefs::pack(held).unwrap_or(PackedRefs::ZERO);
        match table.add_holder(key, parent, slot.slot, offered) {
            Err(_) => {
                if orphan {
                    slot.counters.sub_orphans(1);
                }
                if let Some(parent) = parent {
                    self.forget_child(table, slot, parent);
                }
                return false;
            }
            // The counts moved into the block's slot.
            Ok(true) => self.set_table_node(key, NodeRefs::default()),
            Ok(false) => self.set_table_node(key, held),
        }
        slot.counters.sub_orphans(node.children);
        slot.counters.cached_blocks.fetch_add(1, Ordering::Release);
        true
    }

    /// Undoes one `children` count of `parent`; returns its counts before.
    fn forget_child(&mut self, table: &BlockTable, slot: &WorkerSlot, parent: u64) -> NodeRefs {
        let uncounted = |node: NodeRefs| NodeRefs {
            children: node.children.saturating_sub(1),
            ..node
        };
        self.update(table, slot, parent, uncounted)
    }

    /// Drops one reference to `key`, its own id's when `own`, releasing the block when none
    /// is left.
    fn release(&mut self, table: &BlockTable, slot: &WorkerSlot, key: u64, own: bool) {
        let (node, place) = self.node(table, slot, key);
        if node.refs == 0 {
            return;
        }
        let left = NodeRefs {
            refs: node.refs - 1,
            children: node.children,
            own: node.own && !own,
        };
        if left.refs > 0 {
            self.set_node(table, slot, key, left, place);
            return;
        }
        // Held children become orphans before the block disappears from lookups.
        slot.counters.add_orphans(node.children);
        // Removing the holder ends an ownership: what is left of the counts goes to the table.
        let parent = table.remove_holder(key, slot.slot).flatten();
        self.set_table_node(key, left);
        slot.counters.cached_blocks.fetch_sub(1, Ordering::Release);
        let Some(parent) = parent else {
            return;
        };
        let parent_node = self.forget_child(table, slot, parent);
        if parent_node.children > 0 && parent_node.refs == 0 {
            slot.counters.sub_orphans(1);
        }
    }
}

//! One worker's view of its blocks: engine ids, reference counts and orphan accounting.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::event::{BlockParent, StoredBlock};
use crate::hash::{ExternalHash, sequence_hash};
use crate::outcome::ApplyOutcome;
use crate::worker::WorkerKey;

use super::block_table::BlockTable;
use super::ordered_table::{OrderedTable, join, split};

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
    blocks: Mutex<WorkerBlocks>,
}

impl WorkerSlot {
    /// A fresh, empty worker in slot `slot`.
    pub(crate) fn new(key: WorkerKey, slot: u32) -> Self {
        Self {
            key,
            slot,
            counters: WorkerCounters::default(),
            blocks: Mutex::new(WorkerBlocks::default()),
        }
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

/// Reference counts of one sequence hash in one worker.
#[derive(Debug, Clone, Copy, Default)]
struct NodeRefs {
    /// Engine ids of this worker that map to the block; held while non-zero.
    refs: u32,
    /// Held blocks of this worker whose parent is this block.
    children: u32,
}

/// One worker's blocks. Every method runs under the worker's lock.
///
/// Keys are mixed ([`super::key_mixer::KeyMixer`], the block table's): engine ids and sequence
/// hashes alike.
#[derive(Debug, Default)]
pub(crate) struct WorkerBlocks {
    /// Engine id key → block key, to resolve removals and parents.
    external: OrderedTable<[u32; 2]>,
    /// Block key → counts, for held blocks and for unheld parents of held blocks.
    nodes: OrderedTable<NodeRefs>,
    /// Set when the worker was removed from the index; later writers must re-register.
    pub(crate) retired: bool,
}

impl WorkerBlocks {
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
        if let Some(parent) = parent
            && self
                .external
                .get(mixer.mix(parent.external.0))
                .copied()
                .map(join)
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
        outcome
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
            match self.external.remove(mixer.mix(external.0)) {
                Some(key) => {
                    self.release(table, slot, join(key));
                    outcome.blocks_removed += 1;
                }
                None => outcome.blocks_not_found += 1,
            }
        }
        outcome
    }

    /// Drops every block of the worker; returns how many distinct blocks it held.
    pub(crate) fn clear(&mut self, table: &BlockTable, slot: &WorkerSlot) -> u64 {
        let mut cleared = 0;
        for (key, node) in self.nodes.iter() {
            if node.refs > 0 {
                table.remove_holder(key, slot.slot);
                cleared += 1;
            }
        }
        self.nodes.clear();
        self.external.clear();
        slot.counters.cached_blocks.store(0, Ordering::Release);
        slot.counters.orphans.store(0, Ordering::Release);
        cleared
    }

    /// Points engine id key `external` at block key `key`, holding it; false on a parent
    /// mismatch.
    fn map_external(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        external: u64,
        key: u64,
        parent: Option<u64>,
    ) -> bool {
        let old = self.external.insert(external, split(key)).map(join);
        if old == Some(key) {
            return true;
        }
        if !self.acquire(table, slot, key, parent) {
            match old {
                Some(old) => self.external.insert(external, split(old)),
                None => self.external.remove(external),
            };
            return false;
        }
        if let Some(old) = old {
            self.release(table, slot, old);
        }
        true
    }

    /// Adds one reference to `sequence`; false (and nothing changed) on a parent mismatch.
    fn acquire(
        &mut self,
        table: &BlockTable,
        slot: &WorkerSlot,
        sequence: u64,
        parent: Option<u64>,
    ) -> bool {
        let node = self.nodes.get_or_default(sequence);
        if node.refs > 0 {
            node.refs += 1;
            return true;
        }
        // Orphan counts rise before the block becomes visible, and fall after.
        let orphan = match parent {
            Some(parent) => {
                let parent_node = self.nodes.get_or_default(parent);
                parent_node.children += 1;
                parent_node.refs == 0
            }
            None => false,
        };
        if orphan {
            slot.counters.add_orphans(1);
        }
        if table.add_holder(sequence, parent, slot.slot).is_err() {
            if orphan {
                slot.counters.sub_orphans(1);
            }
            if let Some(parent) = parent {
                self.forget_child(parent);
            }
            self.drop_if_unused(sequence);
            return false;
        }
        let adopted = match self.nodes.get_mut(sequence) {
            Some(node) => {
                node.refs = 1;
                node.children
            }
            None => 0,
        };
        slot.counters.sub_orphans(adopted);
        slot.counters.cached_blocks.fetch_add(1, Ordering::Release);
        true
    }

    /// Undoes one `children` count of `parent`.
    fn forget_child(&mut self, parent: u64) {
        if let Some(node) = self.nodes.get_mut(parent) {
            node.children = node.children.saturating_sub(1);
        }
        self.drop_if_unused(parent);
    }

    /// Removes the node of `sequence` when it is neither held nor a parent of held blocks.
    fn drop_if_unused(&mut self, sequence: u64) {
        if self
            .nodes
            .get(sequence)
            .is_some_and(|node| node.refs == 0 && node.children == 0)
        {
            self.nodes.remove(sequence);
        }
    }

    /// Drops one reference to `sequence`, releasing the block when none is left.
    fn release(&mut self, table: &BlockTable, slot: &WorkerSlot, sequence: u64) {
        let Some(node) = self.nodes.get_mut(sequence) else {
            return;
        };
        if node.refs == 0 {
            return;
        }
        node.refs -= 1;
        if node.refs > 0 {
            return;
        }
        let children = node.children;
        if children == 0 {
            self.nodes.remove(sequence);
        }
        // Held children become orphans before the block disappears from lookups.
        slot.counters.add_orphans(children);
        let parent = table.remove_holder(sequence, slot.slot).flatten();
        slot.counters.cached_blocks.fetch_sub(1, Ordering::Release);
        let Some(parent) = parent else {
            return;
        };
        if let Some(parent_node) = self.nodes.get_mut(parent) {
            parent_node.children = parent_node.children.saturating_sub(1);
            if parent_node.refs == 0 {
                slot.counters.sub_orphans(1);
                if parent_node.children == 0 {
                    self.nodes.remove(parent);
                }
            }
        }
    }
}

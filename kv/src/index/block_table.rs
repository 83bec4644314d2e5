//! The shared map from a block's sequence hash to the workers holding it, sharded by key.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::hash::SequenceHash;
use crate::keyed_hasher::KeyedState;

use super::slot_bits::SlotBits;
use super::slot_set::SlotSet;

/// One cached block: its parent and the slots of the workers that hold it (24 bytes).
#[derive(Debug)]
struct BlockEntry {
    /// Sequence hash of the block before it, or the block's own sequence hash for the first
    /// block of a sequence (a block is never its own parent: such blocks are rejected).
    parent: SequenceHash,
    /// Workers holding the block.
    holders: SlotSet,
}

/// The stored form of `parent` for the block `sequence`.
fn encode_parent(sequence: SequenceHash, parent: Option<SequenceHash>) -> SequenceHash {
    parent.unwrap_or(sequence)
}

/// The parent of the block `sequence` from its stored form.
fn decode_parent(sequence: SequenceHash, stored: SequenceHash) -> Option<SequenceHash> {
    (stored != sequence).then_some(stored)
}

type Shard = HashMap<SequenceHash, BlockEntry, KeyedState>;

/// A shard lock on its own pair of cache lines, so that a writer on one shard does not evict
/// the lock word of its neighbours from a reader's cache (adjacent-line prefetch pairs lines).
#[derive(Debug)]
#[repr(align(128))]
struct PaddedShard(RwLock<Shard>);

/// A block was offered with a different parent than the one already recorded for its
/// sequence hash: a 64-bit hash collision (or a forged event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ParentMismatch;

/// Sequence hash → (parent, holders), split into independently locked shards.
///
/// Every operation locks one shard for one map operation, so a reader waits at most for one
/// block-sized write on that shard, never for a whole event or a stream of them.
#[derive(Debug)]
pub(crate) struct BlockTable {
    shards: Box<[PaddedShard]>,
    shard_shift: u32,
    shard_picker: KeyedState,
}

impl BlockTable {
    /// A table with `shards` shards, rounded up to a power of two (at least 1).
    pub(crate) fn new(shards: usize) -> Self {
        let count = shards.max(1).next_power_of_two();
        let map_state = KeyedState::new();
        Self {
            shards: (0..count)
                .map(|_| PaddedShard(RwLock::new(HashMap::with_hasher(map_state))))
                .collect(),
            shard_shift: 64 - count.trailing_zeros(),
            shard_picker: KeyedState::new(),
        }
    }

    /// Number of shards.
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    fn shard_of(&self, sequence: SequenceHash) -> &RwLock<Shard> {
        let index = if self.shards.len() == 1 {
            0
        } else {
            // The top bits of an independent keyed hash: `shard_shift` < 64 here.
            (self.shard_picker.hash_one(sequence) >> self.shard_shift) as usize
        };
        &self.shards[index].0
    }

    fn read(&self, sequence: SequenceHash) -> RwLockReadGuard<'_, Shard> {
        self.shard_of(sequence)
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self, sequence: SequenceHash) -> RwLockWriteGuard<'_, Shard> {
        self.shard_of(sequence)
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records that worker `slot` holds `sequence`, whose parent is `parent` (which must not be
    /// `sequence` itself).
    pub(crate) fn add_holder(
        &self,
        sequence: SequenceHash,
        parent: Option<SequenceHash>,
        slot: u32,
    ) -> Result<(), ParentMismatch> {
        let parent = encode_parent(sequence, parent);
        let mut shard = self.write(sequence);
        match shard.get_mut(&sequence) {
            Some(entry) if entry.parent != parent => Err(ParentMismatch),
            Some(entry) => {
                entry.holders.insert(slot);
                Ok(())
            }
            None => {
                shard.insert(
                    sequence,
                    BlockEntry {
                        parent,
                        holders: SlotSet::one(slot),
                    },
                );
                Ok(())
            }
        }
    }

    /// Drops worker `slot` from `sequence`'s holders (and the block when none is left).
    /// Returns the block's parent when the slot was a holder, `None` otherwise.
    pub(crate) fn remove_holder(
        &self,
        sequence: SequenceHash,
        slot: u32,
    ) -> Option<Option<SequenceHash>> {
        let mut shard = self.write(sequence);
        let entry = shard.get_mut(&sequence)?;
        if !entry.holders.remove(slot) {
            return None;
        }
        let parent = decode_parent(sequence, entry.parent);
        if entry.holders.is_empty() {
            shard.remove(&sequence);
        }
        Some(parent)
    }

    /// Replaces `bits` with the slots holding `sequence` (cleared when nobody does).
    pub(crate) fn holders_into(&self, sequence: SequenceHash, bits: &mut SlotBits) {
        bits.clear();
        let shard = self.read(sequence);
        if let Some(entry) = shard.get(&sequence) {
            entry.holders.add_to(bits);
        }
    }

    /// Whether worker `slot` holds `sequence`.
    pub(crate) fn holds(&self, sequence: SequenceHash, slot: u32) -> bool {
        self.read(sequence)
            .get(&sequence)
            .is_some_and(|entry| entry.holders.contains(slot))
    }

    /// Number of distinct blocks held by at least one worker.
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.0.read().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_stay_small() {
        assert_eq!(size_of::<BlockEntry>(), 24);
    }

    #[test]
    fn parents_are_kept() {
        let table = BlockTable::new(1);
        let (child, parent) = (SequenceHash(2), SequenceHash(1));
        assert_eq!(table.add_holder(child, Some(parent), 0), Ok(()));
        assert_eq!(table.add_holder(child, None, 1), Err(ParentMismatch));
        assert_eq!(table.remove_holder(child, 0), Some(Some(parent)));
    }

    #[test]
    fn holders_come_and_go() {
        for shards in [1, 3, 64] {
            let table = BlockTable::new(shards);
            assert!(table.shard_count().is_power_of_two());
            let s = SequenceHash(7);
            assert_eq!(table.add_holder(s, None, 1), Ok(()));
            assert_eq!(table.add_holder(s, None, 2), Ok(()));
            assert_eq!(
                table.add_holder(s, Some(SequenceHash(1)), 3),
                Err(ParentMismatch)
            );
            assert!(table.holds(s, 1) && table.holds(s, 2) && !table.holds(s, 3));
            let mut bits = SlotBits::default();
            table.holders_into(s, &mut bits);
            assert_eq!(bits.iter().collect::<Vec<_>>(), vec![1, 2]);
            assert_eq!(table.remove_holder(s, 1), Some(None));
            assert_eq!(table.remove_holder(s, 1), None);
            assert_eq!(table.len(), 1);
            assert_eq!(table.remove_holder(s, 2), Some(None));
            assert_eq!(table.len(), 0);
            table.holders_into(s, &mut bits);
            assert!(bits.is_empty());
        }
    }
}

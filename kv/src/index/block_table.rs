//! The shared map from a block's key to its parent and the workers holding it, sharded.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::hash::SequenceHash;

use super::key_mixer::KeyMixer;
use super::ordered_table::{OrderedTable, join, split};
use super::slot_bits::SlotBits;
use super::slot_set::SlotSet;

/// Marks a holder word that indexes the shard's shared holder sets instead of naming a slot:
/// worker slot numbers stay below 2^31.
const SHARED: u32 = 1 << 31;

/// One cached block (12 bytes; 20 with its key): its parent's key, and its holders.
#[derive(Debug, Clone, Copy, Default)]
struct BlockValue {
    /// Key of the block before it, or the block's own key for the first block of a sequence
    /// (a block is never its own parent: such blocks are rejected). Split so the value packs
    /// to 4-byte alignment.
    parent: [u32; 2],
    /// The one worker slot holding the block, or `SHARED | i` for the shard's shared set `i`.
    holders: u32,
}

impl BlockValue {
    fn parent(&self) -> u64 {
        join(self.parent)
    }
}

/// The stored form of `parent` for the block `key`.
fn encode_parent(key: u64, parent: Option<u64>) -> [u32; 2] {
    split(parent.unwrap_or(key))
}

/// The parent of the block `key` from its stored form.
fn decode_parent(key: u64, stored: u64) -> Option<u64> {
    (stored != key).then_some(stored)
}

/// Holder sets of the blocks of one shard held by more than one worker, with free entries.
#[derive(Debug, Default)]
struct SharedHolders {
    sets: Vec<SlotSet>,
    free: Vec<u32>,
}

impl SharedHolders {
    /// Heap bytes of the sets and their free list.
    fn heap_bytes(&self) -> usize {
        self.sets.capacity() * std::mem::size_of::<SlotSet>()
            + self.sets.iter().map(SlotSet::heap_bytes).sum::<usize>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }

    /// The set a holders word refers to, when it refers to one.
    fn set(&self, holders: u32) -> Option<&SlotSet> {
        (holders & SHARED != 0).then(|| &self.sets[(holders & !SHARED) as usize])
    }

    /// Whether the holders word `holders` contains `slot`.
    fn holds(&self, holders: u32, slot: u32) -> bool {
        match self.set(holders) {
            Some(set) => set.contains(slot),
            None => holders == slot,
        }
    }

    /// Adds `slot` to the holders word `holders`, moving a single holder into a set.
    fn add(&mut self, holders: &mut u32, slot: u32) {
        if *holders & SHARED != 0 {
            self.sets[(*holders & !SHARED) as usize].insert(slot);
            return;
        }
        let mut set = SlotSet::one(*holders);
        set.insert(slot);
        let at = match self.free.pop() {
            Some(at) => {
                self.sets[at as usize] = set;
                at
            }
            None => {
                self.sets.push(set);
                // A shard holds far fewer than 2^31 blocks, hence shared sets.
                (self.sets.len() - 1) as u32
            }
        };
        *holders = SHARED | at;
    }

    /// Removes `slot`, a holder, from the shared holders word `holders`; returns the new word,
    /// back to a single slot when one holder is left.
    fn remove(&mut self, holders: u32, slot: u32) -> u32 {
        let at = holders & !SHARED;
        let set = &mut self.sets[at as usize];
        set.remove(slot);
        match set.single() {
            Some(last) => {
                *set = SlotSet::default();
                self.free.push(at);
                last
            }
            None => holders,
        }
    }
}

/// One shard: the blocks, and the holder sets of blocks held by more than one worker.
#[derive(Debug)]
struct Shard {
    blocks: OrderedTable<BlockValue>,
    shared: SharedHolders,
}

/// A shard lock on its own pair of cache lines, so that a writer on one shard does not evict
/// the lock word of its neighbours from a reader's cache (adjacent-line prefetch pairs lines).
#[derive(Debug)]
#[repr(align(128))]
struct PaddedShard(RwLock<Shard>);

/// A block was offered with a different parent than the one already recorded for its
/// sequence hash: a 64-bit hash collision (or a forged event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ParentMismatch;

/// Block key (a mixed sequence hash, [`KeyMixer`]) → (parent key, holders), split into
/// independently locked shards.
///
/// Every operation locks one shard for one table operation, so a reader waits at most for one
/// block-sized write on that shard, never for a whole event or a stream of them.
#[derive(Debug)]
pub(crate) struct BlockTable {
    shards: Box<[PaddedShard]>,
    /// 63 minus the number of shard bits: `key >> 1 >> shard_shift` is the shard.
    shard_shift: u32,
    mixer: KeyMixer,
}

impl BlockTable {
    /// A table with `shards` shards, rounded up to a power of two (at least 1).
    pub(crate) fn new(shards: usize) -> Self {
        let count = shards.max(1).next_power_of_two();
        Self {
            shards: (0..count)
                .map(|_| {
                    PaddedShard(RwLock::new(Shard {
                        blocks: OrderedTable::with_shift(count.trailing_zeros()),
                        shared: SharedHolders::default(),
                    }))
                })
                .collect(),
            shard_shift: 63 - count.trailing_zeros(),
            mixer: KeyMixer::new(),
        }
    }

    /// Number of shards.
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The table key of `sequence`.
    pub(crate) fn key(&self, sequence: SequenceHash) -> u64 {
        self.mixer.mix(sequence.0)
    }

    /// The mixer that turns sequence hashes (and engine ids) into table keys.
    pub(crate) fn mixer(&self) -> &KeyMixer {
        &self.mixer
    }

    fn shard_of(&self, key: u64) -> &RwLock<Shard> {
        // The key's top bits pick the shard, the next ones its bucket in the shard.
        &self.shards[(key >> 1 >> self.shard_shift) as usize].0
    }

    fn read(&self, key: u64) -> RwLockReadGuard<'_, Shard> {
        self.shard_of(key)
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self, key: u64) -> RwLockWriteGuard<'_, Shard> {
        self.shard_of(key)
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records that worker `slot` holds `key`, whose parent is `parent` (which must not be
    /// `key` itself).
    pub(crate) fn add_holder(
        &self,
        key: u64,
        parent: Option<u64>,
        slot: u32,
    ) -> Result<(), ParentMismatch> {
        let parent = encode_parent(key, parent);
        let mut guard = self.write(key);
        let shard = &mut *guard;
        match shard.blocks.get_mut(key) {
            Some(entry) if entry.parent != parent => Err(ParentMismatch),
            Some(entry) => {
                if !shard.shared.holds(entry.holders, slot) {
                    shard.shared.add(&mut entry.holders, slot);
                }
                Ok(())
            }
            None => {
                shard.blocks.insert(
                    key,
                    BlockValue {
                        parent,
                        holders: slot,
                    },
                );
                Ok(())
            }
        }
    }

    /// Drops worker `slot` from `key`'s holders (and the block when none is left).
    /// Returns the block's parent key when the slot was a holder, `None` otherwise.
    pub(crate) fn remove_holder(&self, key: u64, slot: u32) -> Option<Option<u64>> {
        let mut guard = self.write(key);
        let shard = &mut *guard;
        let entry = *shard.blocks.get(key)?;
        if !shard.shared.holds(entry.holders, slot) {
            return None;
        }
        let parent = decode_parent(key, entry.parent());
        if entry.holders & SHARED != 0 {
            let holders = shard.shared.remove(entry.holders, slot);
            if let Some(entry) = shard.blocks.get_mut(key) {
                entry.holders = holders;
            }
        } else {
            shard.blocks.remove(key);
        }
        Some(parent)
    }

    /// Replaces `bits` with the slots holding `key` (cleared when nobody does).
    pub(crate) fn holders_into(&self, key: u64, bits: &mut SlotBits) {
        bits.clear();
        let shard = self.read(key);
        if let Some(entry) = shard.blocks.get(key) {
            match shard.shared.set(entry.holders) {
                Some(set) => set.add_to(bits),
                None => bits.insert(entry.holders),
            }
        }
    }

    /// Whether worker `slot` holds `key`.
    pub(crate) fn holds(&self, key: u64, slot: u32) -> bool {
        let shard = self.read(key);
        shard
            .blocks
            .get(key)
            .is_some_and(|entry| shard.shared.holds(entry.holders, slot))
    }

    /// Heap bytes of the shards: their locks and tables (each shard read-locked in turn).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.shards.len() * std::mem::size_of::<PaddedShard>()
            + self
                .shards
                .iter()
                .map(|shard| {
                    let shard = shard.0.read().unwrap_or_else(PoisonError::into_inner);
                    shard.blocks.heap_bytes() + shard.shared.heap_bytes()
                })
                .sum::<usize>()
    }

    /// Number of distinct blocks held by at least one worker.
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| {
                shard
                    .0
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .blocks
                    .len()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_stay_small() {
        assert_eq!(size_of::<BlockValue>(), 12);
    }

    #[test]
    fn parents_are_kept() {
        let table = BlockTable::new(1);
        let (child, parent) = (2, 1);
        assert_eq!(table.add_holder(child, Some(parent), 0), Ok(()));
        assert_eq!(table.add_holder(child, None, 1), Err(ParentMismatch));
        assert_eq!(table.remove_holder(child, 0), Some(Some(parent)));
    }

    #[test]
    fn holders_come_and_go() {
        for shards in [1, 3, 64] {
            let table = BlockTable::new(shards);
            assert!(table.shard_count().is_power_of_two());
            let s = 7;
            assert_eq!(table.add_holder(s, None, 1), Ok(()));
            assert_eq!(table.add_holder(s, None, 2), Ok(()));
            assert_eq!(table.add_holder(s, None, 2), Ok(()));
            assert_eq!(table.add_holder(s, Some(1), 3), Err(ParentMismatch));
            assert!(table.holds(s, 1) && table.holds(s, 2) && !table.holds(s, 3));
            let mut bits = SlotBits::default();
            table.holders_into(s, &mut bits);
            assert_eq!(bits.iter().collect::<Vec<_>>(), vec![1, 2]);
            assert_eq!(table.remove_holder(s, 1), Some(None));
            assert_eq!(table.remove_holder(s, 1), None);
            assert_eq!(table.len(), 1);
            table.holders_into(s, &mut bits);
            assert_eq!(bits.iter().collect::<Vec<_>>(), vec![2]);
            // A freed shared set is reused by the next shared block.
            assert_eq!(table.add_holder(s, None, 4), Ok(()));
            assert_eq!(table.remove_holder(s, 2), Some(None));
            assert_eq!(table.remove_holder(s, 4), Some(None));
            assert_eq!(table.len(), 0);
            table.holders_into(s, &mut bits);
            assert!(bits.is_empty());
        }
    }
}

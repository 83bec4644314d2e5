//! The shared map from a block's key to its parent, the workers holding it and its owner's
//! counts, sharded.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::hash::SequenceHash;

use super::key_mixer::KeyMixer;
use super::node_refs::{NodeRefs, PackedRefs};
use super::ordered_table::{OrderedTable, join, split};
use super::slot_bits::SlotBits;
use super::slot_set::SlotSet;

/// Marks a holder word that indexes the shard's shared holder sets instead of naming a slot:
/// worker slot numbers stay below 2^31.
const SHARED: u32 = 1 << 31;

/// One cached block (16 bytes; 24 with its key): its parent's key, its holders, and the
/// counts of its owner.
///
/// The owner is one holder whose counts for the block live here instead of in its own table
/// ([`super::worker_blocks`]): most blocks have one holder, so most (worker, block) pairs cost
/// no second table slot. The first worker to hold a block with no owner becomes its owner, and
/// stays so until it stops holding it (or its counts outgrow the packed form); only the
/// owner's writer changes `owned`, under the shard's lock, so no writer ever changes another
/// worker's counts.
#[derive(Debug, Clone, Copy, Default)]
struct BlockValue {
    /// Key of the block before it, or the block's own key for the first block of a sequence
    /// (a block is never its own parent: such blocks are rejected). Split so the value packs
    /// to 4-byte alignment.
    parent: [u32; 2],
    /// The one worker slot holding the block, or `SHARED | i` for the shard's shared set `i`.
    holders: u32,
    /// The owner's counts; all zero when the block has no owner.
    owned: PackedRefs,
}

impl BlockValue {
    fn parent(&self) -> u64 {
        join(self.parent)
    }

    /// Whether the block has an owner.
    fn has_owner(&self) -> bool {
        self.owned.holds()
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
    /// The owner of set `i`'s block (meaningful while the block has one).
    owners: Vec<u32>,
    free: Vec<u32>,
}

impl SharedHolders {
    /// Heap bytes of the sets and their free list.
    fn heap_bytes(&self) -> usize {
        self.sets.capacity() * std::mem::size_of::<SlotSet>()
            + self.sets.iter().map(SlotSet::heap_bytes).sum::<usize>()
            + (self.owners.capacity() + self.free.capacity()) * std::mem::size_of::<u32>()
    }

    /// The owner of `entry` (a block of this shard), when it has one.
    fn owner(&self, entry: &BlockValue) -> Option<u32> {
        if !entry.has_owner() {
            return None;
        }
        Some(match entry.holders & SHARED {
            0 => entry.holders,
            _ => self.owners[(entry.holders & !SHARED) as usize],
        })
    }

    /// Makes `slot`, a holder of `entry`, its owner.
    fn set_owner(&mut self, entry: &mut BlockValue, slot: u32, owned: PackedRefs) {
        if entry.holders & SHARED != 0 {
            self.owners[(entry.holders & !SHARED) as usize] = slot;
        }
        entry.owned = owned;
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

    /// Adds `slot` to the holders word `holders`, moving a single holder into a set (which
    /// keeps it as the owner, should it be one).
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
                self.owners[at as usize] = *holders;
                at
            }
            None => {
                self.sets.push(set);
                self.owners.push(*holders);
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

    /// Records that worker `slot`, not yet a holder, holds `key`, whose parent is `parent`
    /// (which must not be `key` itself). The worker becomes the block's owner when the block
    /// has none, with `counts` as its counts (unless they are all zero); returns whether it
    /// did.
    pub(crate) fn add_holder(
        &self,
        key: u64,
        parent: Option<u64>,
        slot: u32,
        counts: PackedRefs,
    ) -> Result<bool, ParentMismatch> {
        let parent = encode_parent(key, parent);
        let mut guard = self.write(key);
        let shard = &mut *guard;
        match shard.blocks.get_mut(key) {
            Some(entry) if entry.parent != parent => Err(ParentMismatch),
            Some(entry) => {
                if !shard.shared.holds(entry.holders, slot) {
                    shard.shared.add(&mut entry.holders, slot);
                }
                if entry.has_owner() || !counts.holds() {
                    return Ok(false);
                }
                shard.shared.set_owner(entry, slot, counts);
                Ok(true)
            }
            None => {
                shard.blocks.insert(
                    key,
                    BlockValue {
                        parent,
                        holders: slot,
                        owned: counts,
                    },
                );
                Ok(counts.holds())
            }
        }
    }

    /// Drops worker `slot` from `key`'s holders (and the block when none is left), and with it
    /// the worker's ownership. Returns the block's parent key when the slot was a holder,
    /// `None` otherwise.
    pub(crate) fn remove_holder(&self, key: u64, slot: u32) -> Option<Option<u64>> {
        let mut guard = self.write(key);
        let shard = &mut *guard;
        let entry = *shard.blocks.get(key)?;
        if !shard.shared.holds(entry.holders, slot) {
            return None;
        }
        let parent = decode_parent(key, entry.parent());
        if entry.holders & SHARED != 0 {
            let owned = match shard.shared.owner(&entry) {
                Some(owner) if owner == slot => PackedRefs::ZERO,
                _ => entry.owned,
            };
            let holders = shard.shared.remove(entry.holders, slot);
            if let Some(entry) = shard.blocks.get_mut(key) {
                entry.holders = holders;
                entry.owned = owned;
            }
        } else {
            shard.blocks.remove(key);
        }
        Some(parent)
    }

    /// The counts of `key` that worker `slot` keeps here, when it is the block's owner.
    pub(crate) fn owned(&self, key: u64, slot: u32) -> Option<PackedRefs> {
        let shard = self.read(key);
        let entry = shard.blocks.get(key)?;
        (shard.shared.owner(entry) == Some(slot)).then_some(entry.owned)
    }

    /// Applies `change` to the counts of `key`'s owner, worker `slot`, under one lock, and
    /// returns the counts before it; `None`, and nothing changed, when `slot` is not the owner.
    /// Counts that come out all zero or too wide to pack give the ownership up (the worker
    /// stays a holder) and are the caller's to keep: the flag says whether they were kept here.
    pub(crate) fn change_owned(
        &self,
        key: u64,
        slot: u32,
        change: impl FnOnce(NodeRefs) -> NodeRefs,
    ) -> Option<(NodeRefs, bool)> {
        let mut guard = self.write(key);
        let shard = &mut *guard;
        let entry = shard.blocks.get_mut(key)?;
        if shard.shared.owner(entry) != Some(slot) {
            return None;
        }
        let before = entry.owned.unpack();
        let packed = PackedRefs::pack(change(before))
            .filter(|packed| packed.holds())
            .unwrap_or(PackedRefs::ZERO);
        entry.owned = packed;
        Some((before, packed.holds()))
    }

    /// Drops worker `slot` from every block it owns, visiting every shard; returns how many
    /// blocks that was. For clearing a worker: the blocks it holds without owning them are in
    /// its own table. Each shard is scanned under its read lock, so lookups go on, and
    /// write-locked only to drop what the scan found (other writers cannot take or end the
    /// worker's ownership meanwhile: only the worker's own writer does, and it is the caller).
    pub(crate) fn remove_owned(&self, slot: u32) -> u64 {
        let mut owned = Vec::new();
        let mut removed = 0;
        for shard in &self.shards {
            owned.clear();
            {
                let shard = shard.0.read().unwrap_or_else(PoisonError::into_inner);
                owned.extend(
                    shard
                        .blocks
                        .iter()
                        .filter(|(_, entry)| shard.shared.owner(entry) == Some(slot))
                        .map(|(key, _)| key),
                );
            }
            if owned.is_empty() {
                continue;
            }
            let mut guard = shard.0.write().unwrap_or_else(PoisonError::into_inner);
            let shard = &mut *guard;
            for &key in &owned {
                let Some(entry) = shard.blocks.get_mut(key) else {
                    continue;
                };
                if entry.holders & SHARED != 0 {
                    entry.holders = shard.shared.remove(entry.holders, slot);
                    entry.owned = PackedRefs::ZERO;
                } else {
                    shard.blocks.remove(key);
                }
            }
            removed += owned.len() as u64;
        }
        removed
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

    /// No counts: a holder that does not become the owner.
    const NONE: PackedRefs = PackedRefs::ZERO;

    fn one_ref() -> PackedRefs {
        PackedRefs::pack(NodeRefs {
            refs: 1,
            children: 0,
            own: true,
        })
        .expect("fits")
    }

    #[test]
    fn blocks_stay_small() {
        assert_eq!(size_of::<BlockValue>(), 16);
    }

    #[test]
    fn the_first_holder_owns_a_block_until_it_lets_go() {
        let table = BlockTable::new(4);
        let key = 9;
        assert_eq!(table.add_holder(key, None, 1, one_ref()), Ok(true));
        assert_eq!(table.owned(key, 1), Some(one_ref()));
        // A second holder joins without ownership; the owner's counts stay.
        assert_eq!(table.add_holder(key, None, 2, one_ref()), Ok(false));
        assert_eq!(table.owned(key, 2), None);
        assert_eq!(table.owned(key, 1), Some(one_ref()));
        assert_eq!(table.change_owned(key, 2, |_| unreachable!()), None);
        // The owner leaves: the block has no owner, and the next holder to join takes it.
        assert_eq!(table.remove_holder(key, 1), Some(None));
        assert_eq!(table.owned(key, 2), None);
        assert_eq!(table.add_holder(key, None, 3, one_ref()), Ok(true));
        assert_eq!(table.owned(key, 3), Some(one_ref()));
        // Counts change in place; counts too wide to pack give the ownership up, and the
        // holder stays.
        let two = |node: NodeRefs| NodeRefs {
            refs: node.refs + 1,
            ..node
        };
        assert_eq!(
            table.change_owned(key, 3, two),
            Some((one_ref().unpack(), true))
        );
        assert_eq!(
            table.owned(key, 3).map(PackedRefs::unpack).map(|n| n.refs),
            Some(2)
        );
        let wide = |node: NodeRefs| NodeRefs {
            children: 1 << 20,
            ..node
        };
        assert!(matches!(table.change_owned(key, 3, wide), Some((_, false))));
        assert_eq!(table.owned(key, 3), None);
        assert!(table.holds(key, 3));
        // Clearing a worker removes the blocks it owns, and only those.
        assert_eq!(table.add_holder(10, None, 2, one_ref()), Ok(true));
        assert_eq!(table.add_holder(11, None, 3, one_ref()), Ok(true));
        assert_eq!(table.add_holder(11, None, 2, one_ref()), Ok(false));
        assert_eq!(table.remove_owned(2), 1);
        assert!(!table.holds(10, 2) && table.holds(9, 2) && table.holds(11, 2));
        assert_eq!(table.remove_owned(3), 1);
        assert_eq!(table.owned(11, 2), None);
        assert!(table.holds(11, 2) && !table.holds(11, 3) && table.holds(9, 3));
    }

    #[test]
    fn parents_are_kept() {
        let table = BlockTable::new(1);
        let (child, parent) = (2, 1);
        assert_eq!(table.add_holder(child, Some(parent), 0, NONE), Ok(false));
        assert_eq!(table.add_holder(child, None, 1, NONE), Err(ParentMismatch));
        assert_eq!(table.remove_holder(child, 0), Some(Some(parent)));
    }

    #[test]
    fn holders_come_and_go() {
        for shards in [1, 3, 64] {
            let table = BlockTable::new(shards);
            assert!(table.shard_count().is_power_of_two());
            let s = 7;
            assert_eq!(table.add_holder(s, None, 1, NONE), Ok(false));
            assert_eq!(table.add_holder(s, None, 2, NONE), Ok(false));
            assert_eq!(table.add_holder(s, None, 2, NONE), Ok(false));
            assert_eq!(table.add_holder(s, Some(1), 3, NONE), Err(ParentMismatch));
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
            assert_eq!(table.add_holder(s, None, 4, NONE), Ok(false));
            assert_eq!(table.remove_holder(s, 2), Some(None));
            assert_eq!(table.remove_holder(s, 4), Some(None));
            assert_eq!(table.len(), 0);
            table.holders_into(s, &mut bits);
            assert!(bits.is_empty());
        }
    }
}

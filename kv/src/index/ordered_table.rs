//! A compact hash table of 64-bit keys: ordered linear probing, no control bytes, no tombstones.
//!
//! Keys must already be uniformly distributed (the index stores keyed mixes of its hashes,
//! [`super::key_mixer`]). A key's home bucket is `key · buckets / 2^64`, which is monotone in
//! the key, and the table keeps every occupied slot sorted by key with no empty slot between a
//! key's home and its position. So a lookup scans from the home slot while keys are smaller and
//! stops at the first key that is not: a hit or a miss costs the same short scan, usually within
//! one cache line. An empty slot holds the key `u64::MAX`, which sorts after every key and so
//! also ends a scan; the one real key equal to it is kept apart.
//!
//! Inserting shifts the rest of its cluster one slot right; removing shifts back the entries
//! that are not at their home (backward-shift deletion), so no tombstones accumulate. The table
//! grows by a quarter when it is 7/8 full, so it is 70–88 % full once grown; like any hash map
//! it keeps its peak size.

/// The key of an empty slot.
const EMPTY: u64 = u64::MAX;

/// Fill ratio that triggers growth: `MAX_LOAD_NUM / MAX_LOAD_DEN`.
const MAX_LOAD_NUM: usize = 7;
const MAX_LOAD_DEN: usize = 8;

/// Buckets of the first allocation.
const MIN_BUCKETS: usize = 8;

/// `word` as two `u32`s (low first), for values that must pack to 4-byte alignment.
pub(crate) fn split(word: u64) -> [u32; 2] {
    [word as u32, (word >> 32) as u32]
}

/// The `u64` that [`split`] split.
pub(crate) fn join(halves: [u32; 2]) -> u64 {
    u64::from(halves[0]) | u64::from(halves[1]) << 32
}

/// The home bucket of `placed` (a key's bits that place it) among `buckets`: monotone in
/// `placed`.
fn home(placed: u64, buckets: usize) -> usize {
    ((u128::from(placed) * buckets as u128) >> 64) as usize
}

/// One slot: a key split in two `u32`s (so slots of 4-byte values pack without padding) and
/// its value.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct Slot<V> {
    key: [u32; 2],
    value: V,
}

impl<V: Copy + Default> Slot<V> {
    fn new(key: u64, value: V) -> Self {
        Self {
            key: split(key),
            value,
        }
    }

    fn empty() -> Self {
        Self::new(EMPTY, V::default())
    }

    fn key(&self) -> u64 {
        join(self.key)
    }
}

/// A map from uniformly distributed `u64` keys to small `Copy` values.
#[derive(Debug, Clone)]
pub(crate) struct OrderedTable<V> {
    /// `buckets` home slots plus a tail for the last clusters; the last slot is always empty.
    slots: Vec<Slot<V>>,
    buckets: usize,
    /// Bits of the key above those that place it: every key of the table has the same top
    /// `shift` bits (a shard of a larger table), so they are shifted out first.
    shift: u32,
    len: usize,
    /// The value of the key `u64::MAX`, which cannot be stored in a slot.
    max_key: Option<V>,
}

impl<V: Copy + Default> Default for OrderedTable<V> {
    fn default() -> Self {
        Self::with_shift(0)
    }
}

impl<V: Copy + Default> OrderedTable<V> {
    /// An empty table whose keys all share their top `shift` bits (`shift` < 64).
    pub(crate) fn with_shift(shift: u32) -> Self {
        Self {
            slots: vec![Slot::empty()],
            buckets: 0,
            shift,
            len: 0,
            max_key: None,
        }
    }

    /// Heap bytes of the table's slots.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot<V>>()
    }

    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.max_key.is_some())
    }

    fn home(&self, key: u64) -> usize {
        home(key << self.shift, self.buckets)
    }

    /// The first position at or after `key`'s home whose key is not smaller than `key`.
    fn lower_bound(&self, key: u64) -> usize {
        let mut at = self.home(key);
        // Terminates: the last slot is empty, and the empty key sorts after every key.
        while self.slots[at].key() < key {
            at += 1;
        }
        at
    }

    /// The value of `key`.
    pub(crate) fn get(&self, key: u64) -> Option<&V> {
        if key == EMPTY {
            return self.max_key.as_ref();
        }
        let slot = &self.slots[self.lower_bound(key)];
        (slot.key() == key).then_some(&slot.value)
    }

    /// The value of `key`, mutably.
    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if key == EMPTY {
            return self.max_key.as_mut();
        }
        let at = self.lower_bound(key);
        let slot = &mut self.slots[at];
        (slot.key() == key).then_some(&mut slot.value)
    }

    /// Sets `key` to `value`; returns the previous value.
    pub(crate) fn insert(&mut self, key: u64, value: V) -> Option<V> {
        if key == EMPTY {
            return self.max_key.replace(value);
        }
        let at = self.lower_bound(key);
        if self.slots[at].key() == key {
            return Some(std::mem::replace(&mut self.slots[at].value, value));
        }
        self.insert_new(key, value);
        None
    }

    /// Inserts an absent `key`; returns its position.
    fn insert_new(&mut self, key: u64, value: V) -> usize {
        loop {
            if (self.len + 1) * MAX_LOAD_DEN > self.buckets * MAX_LOAD_NUM {
                self.grow();
            }
            let at = self.lower_bound(key);
            let mut free = at;
            while self.slots[free].key() != EMPTY {
                free += 1;
            }
            if free + 1 == self.slots.len() {
                // The shift would fill the last slot, which must stay empty.
                self.grow();
                continue;
            }
            self.slots.copy_within(at..free, at + 1);
            self.slots[at] = Slot::new(key, value);
            self.len += 1;
            return at;
        }
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        if key == EMPTY {
            return self.max_key.take();
        }
        let mut at = self.lower_bound(key);
        if self.slots[at].key() != key {
            return None;
        }
        let value = self.slots[at].value;
        loop {
            let next = self.slots[at + 1];
            let next_key = next.key();
            if next_key == EMPTY || self.home(next_key) > at {
                break;
            }
            self.slots[at] = next;
            at += 1;
        }
        self.slots[at] = Slot::empty();
        self.len -= 1;
        Some(value)
    }

    /// Removes every key, keeping the allocation.
    pub(crate) fn clear(&mut self) {
        self.slots.fill(Slot::empty());
        self.len = 0;
        self.max_key = None;
    }

    /// Every (key, value), in no useful order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &V)> + '_ {
        self.slots
            .iter()
            .filter(|slot| slot.key() != EMPTY)
            .map(|slot| (slot.key(), &slot.value))
            .chain(self.max_key.as_ref().map(|value| (EMPTY, value)))
    }

    /// Rebuilds with a quarter more buckets.
    fn grow(&mut self) {
        self.resize((self.buckets + self.buckets / 4).max(MIN_BUCKETS));
    }

    /// Gives memory back once at most a quarter of the buckets are used: rebuilds with half
    /// again as many buckets as keys (two thirds full, so far from growing again). The tables
    /// otherwise keep their peak size.
    pub(crate) fn shrink(&mut self) {
        if self.buckets > MIN_BUCKETS && self.len * 4 < self.buckets {
            self.resize((self.len + self.len / 2).max(MIN_BUCKETS));
        }
    }

    /// Rebuilds with `buckets` buckets, which hold the keys below the maximum load.
    fn resize(&mut self, buckets: usize) {
        let mut tail = 4 + buckets / 64;
        loop {
            if let Some(slots) = self.rebuilt(buckets, tail) {
                self.slots = slots;
                self.buckets = buckets;
                return;
            }
            tail *= 2;
        }
    }

    /// The slots laid out for `buckets` home slots and `tail` more, or `None` when the last
    /// cluster would reach the last slot. Keys are already sorted, so each goes at its home or
    /// right after the previous one.
    fn rebuilt(&self, buckets: usize, tail: usize) -> Option<Vec<Slot<V>>> {
        let mut slots = vec![Slot::empty(); buckets + tail];
        let mut next = 0;
        for slot in self.slots.iter().filter(|slot| slot.key() != EMPTY) {
            let home = home(slot.key() << self.shift, buckets);
            let at = home.max(next);
            if at + 1 >= slots.len() {
                return None;
            }
            slots[at] = *slot;
            next = at + 1;
        }
        Some(slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// SplitMix64, for well-spread test keys.
    fn mix(seed: u64) -> u64 {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    #[test]
    fn shrink_gives_back_memory_and_keeps_the_keys() {
        let mut table = OrderedTable::default();
        for i in 0..10_000u64 {
            table.insert(mix(i), i as u32);
        }
        let peak = table.slots.len();
        for i in 100..10_000u64 {
            assert_eq!(table.remove(mix(i)), Some(i as u32));
        }
        table.shrink();
        check_invariants(&table);
        assert!(
            table.slots.len() * 20 < peak,
            "{} of {peak}",
            table.slots.len()
        );
        for i in 0..100u64 {
            assert_eq!(table.get(mix(i)), Some(&(i as u32)));
        }
        let kept = table.slots.len();
        table.shrink();
        assert_eq!(
            table.slots.len(),
            kept,
            "two thirds full: nothing to give back"
        );
    }

    fn check_invariants(table: &OrderedTable<u32>) {
        let mut previous = None;
        for (at, slot) in table.slots.iter().enumerate() {
            let key = slot.key();
            if key == EMPTY {
                continue;
            }
            assert!(table.home(key) <= at, "key before its home");
            assert!(
                table.slots[table.home(key)..at]
                    .iter()
                    .all(|s| s.key() != EMPTY),
                "gap between home and position"
            );
            assert!(previous < Some(key), "keys out of order");
            previous = Some(key);
        }
        assert_eq!(table.slots.last().map(Slot::key), Some(EMPTY));
    }

    #[test]
    fn agrees_with_a_hash_map_under_random_operations() {
        let mut table = OrderedTable::<u32>::default();
        let mut model = HashMap::new();
        for step in 0..40_000u64 {
            let r = mix(step);
            // A small key space, so removals and re-inserts hit existing keys; some keys
            // cluster (equal high bits) and the largest key is among them.
            let key = match r % 7 {
                0 => u64::MAX - (r >> 40) % 4,
                1 => (r >> 8) % 64,
                _ => mix((r >> 8) % 3_000),
            };
            match (r >> 4) % 4 {
                0 | 1 => assert_eq!(
                    table.insert(key, step as u32),
                    model.insert(key, step as u32)
                ),
                2 => assert_eq!(table.remove(key), model.remove(&key)),
                _ => {
                    let value = table.get(key).copied().unwrap_or_default() + 1;
                    table.insert(key, value);
                    *model.entry(key).or_default() += 1;
                }
            }
            assert_eq!(table.get(key), model.get(&key));
            assert_eq!(table.len(), model.len());
            if step % 4_000 == 0 {
                check_invariants(&table);
            }
        }
        check_invariants(&table);
        let mut all: Vec<(u64, u32)> = table.iter().map(|(k, &v)| (k, v)).collect();
        all.sort_unstable();
        let mut want: Vec<(u64, u32)> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(all, want);
        table.clear();
        assert_eq!(table.len(), 0);
        assert_eq!(table.get(all[0].0), None);
    }

    #[test]
    fn stays_between_70_and_88_percent_full_once_grown() {
        let mut table = OrderedTable::<u32>::default();
        for i in 0..100_000u64 {
            table.insert(mix(i), 0);
            if i > 1_000 {
                let load = table.len() as f64 / table.slots.len() as f64;
                assert!((0.66..=0.88).contains(&load), "load {load} at {i}");
            }
        }
        check_invariants(&table);
    }

    #[test]
    fn slots_pack_without_padding() {
        assert_eq!(size_of::<Slot<[u32; 3]>>(), 20);
        assert_eq!(size_of::<Slot<[u32; 2]>>(), 16);
    }
}

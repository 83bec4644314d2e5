//! A bounded cache of the ids of short pieces that are not a single token (rare words, invented
//! names), so the merge loop runs once per distinct piece rather than once per occurrence.
//!
//! Direct-mapped: each key has one slot, and a new piece overwrites whatever was there. So
//! lookups and inserts are O(1) whatever the text (no probe sequence an attacker could make
//! long) and memory is fixed. Each slot is a sequence lock made of atomics: a reader never
//! waits or writes shared memory, it retries nothing and just misses when a writer is busy
//! with that slot; a writer that finds the slot busy skips its insert.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use super::fast_hash::FastHashBuilder;

/// Pieces with more ids than this are not cached.
const MAX_IDS: usize = 6;
/// Slots (a power of two).
const SLOTS: usize = 1 << 15;

/// One cached piece. `version` is odd while a writer fills the slot; `len == 0` is empty.
#[derive(Debug, Default)]
struct Slot {
    version: AtomicU32,
    len: AtomicU32,
    key_low: AtomicU64,
    key_high: AtomicU64,
    ids: [AtomicU32; MAX_IDS],
}

/// The cache: [`SLOTS`] slots of 48 bytes (1.5 MiB).
#[derive(Debug)]
pub(crate) struct PieceCache {
    slots: Box<[Slot]>,
}

impl PieceCache {
    /// An empty cache.
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| Slot::default()).collect(),
        }
    }

    fn slot(&self, key: u128) -> &Slot {
        &self.slots[FastHashBuilder.hash_one(key) as usize % SLOTS]
    }

    /// Appends the cached ids of the piece with `key` to `out`; false on a miss.
    pub(crate) fn get(&self, key: u128, out: &mut Vec<u32>) -> bool {
        let slot = self.slot(key);
        let before = slot.version.load(Ordering::Acquire);
        if before % 2 == 1 {
            return false;
        }
        let len = slot.len.load(Ordering::Relaxed) as usize;
        let stored = u128::from(slot.key_low.load(Ordering::Relaxed))
            | (u128::from(slot.key_high.load(Ordering::Relaxed)) << 64);
        let mut ids = [0u32; MAX_IDS];
        for (id, stored) in ids.iter_mut().zip(&slot.ids) {
            *id = stored.load(Ordering::Relaxed);
        }
        // The loads above complete before the version is read again.
        fence(Ordering::Acquire);
        let after = slot.version.load(Ordering::Relaxed);
        if after != before || stored != key || len == 0 || len > MAX_IDS {
            return false;
        }
        out.extend_from_slice(&ids[..len]);
        true
    }

    /// Remembers the ids of the piece with `key` (unless there are too many, or another
    /// thread is writing the same slot).
    pub(crate) fn insert(&self, key: u128, ids: &[u32]) {
        if ids.is_empty() || ids.len() > MAX_IDS {
            return;
        }
        let slot = self.slot(key);
        let version = slot.version.load(Ordering::Relaxed);
        if version % 2 == 1
            || slot
                .version
                .compare_exchange(
                    version,
                    version.wrapping_add(1),
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        // The odd version is visible before any of the stores below.
        fence(Ordering::Release);
        slot.len.store(ids.len() as u32, Ordering::Relaxed);
        slot.key_low.store(key as u64, Ordering::Relaxed);
        slot.key_high.store((key >> 64) as u64, Ordering::Relaxed);
        for (stored, &id) in slot.ids.iter().zip(ids) {
            stored.store(id, Ordering::Relaxed);
        }
        slot.version
            .store(version.wrapping_add(2), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_misses_and_overwrites() {
        let cache = PieceCache::new();
        let mut out = vec![9];
        assert!(!cache.get(1, &mut out));
        cache.insert(1, &[4, 5]);
        assert!(cache.get(1, &mut out));
        assert_eq!(out, [9, 4, 5]);
        cache.insert(1, &[6]);
        out.clear();
        assert!(cache.get(1, &mut out));
        assert_eq!(out, [6]);
        assert!(!cache.get(2, &mut out));
    }

    #[test]
    fn long_id_lists_are_not_cached() {
        let cache = PieceCache::new();
        cache.insert(3, &[1; MAX_IDS + 1]);
        assert!(!cache.get(3, &mut Vec::new()));
    }

    #[test]
    fn colliding_keys_replace_each_other() {
        let cache = PieceCache::new();
        let keys = 1..=(SLOTS * 4) as u128;
        for key in keys.clone() {
            cache.insert(key, &[key as u32]);
        }
        let mut out = Vec::new();
        let hits = keys.filter(|&key| cache.get(key, &mut out)).count();
        assert!(hits <= SLOTS, "{hits} hits");
        assert!(hits > SLOTS / 2, "{hits} hits");
        assert_eq!(out.len(), hits);
    }

    #[test]
    fn readers_never_see_a_torn_slot() {
        // Keys whose ids are a function of the key; writers overwrite the same few slots.
        let cache = PieceCache::new();
        let ids_of = |key: u128| -> Vec<u32> {
            let n = (key % MAX_IDS as u128) as usize + 1;
            (0..n)
                .map(|i| (key as u32).wrapping_mul(31).wrapping_add(i as u32))
                .collect()
        };
        std::thread::scope(|scope| {
            for thread in 0..3u128 {
                let cache = &cache;
                scope.spawn(move || {
                    for round in 0..20_000u128 {
                        let key = 1 + (round * 7 + thread) % 64;
                        cache.insert(key, &ids_of(key));
                        let mut out = Vec::new();
                        if cache.get(key, &mut out) {
                            assert_eq!(out, ids_of(key));
                        }
                    }
                });
            }
        });
    }
}

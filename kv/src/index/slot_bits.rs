//! A growable bitset of worker slots: the working sets of a lookup, and the holders of widely
//! shared blocks.

/// A set of worker slots as bits (slot `s` is bit `s % 64` of word `s / 64`).
#[derive(Debug, Clone, Default)]
pub(crate) struct SlotBits {
    words: Vec<u64>,
}

/// The word index and bit mask of `slot`.
fn position(slot: u32) -> (usize, u64) {
    ((slot / 64) as usize, 1 << (slot % 64))
}

impl SlotBits {
    /// Heap bytes of the set's words.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.words.capacity() * std::mem::size_of::<u64>()
    }

    /// Empties the set, keeping its allocation.
    pub(crate) fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Adds `slot`.
    pub(crate) fn insert(&mut self, slot: u32) {
        let (word, mask) = position(slot);
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= mask;
    }

    /// Removes `slot`; returns false when it was absent.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let (word, mask) = position(slot);
        match self.words.get_mut(word) {
            Some(bits) if *bits & mask != 0 => {
                *bits &= !mask;
                true
            }
            _ => false,
        }
    }

    /// Whether `slot` is in the set.
    pub(crate) fn contains(&self, slot: u32) -> bool {
        let (word, mask) = position(slot);
        self.words.get(word).is_some_and(|bits| bits & mask != 0)
    }

    /// Number of slots in the set.
    pub(crate) fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether the set is empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.words.iter().all(|&word| word == 0)
    }

    /// Adds every slot of `other`.
    pub(crate) fn union_with(&mut self, other: &Self) {
        if other.words.len() > self.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (word, &add) in self.words.iter_mut().zip(&other.words) {
            *word |= add;
        }
    }

    /// Whether every slot of `self` is in `other`.
    pub(crate) fn is_subset_of(&self, other: &Self) -> bool {
        self.words
            .iter()
            .enumerate()
            .all(|(i, &word)| word & !other.words.get(i).copied().unwrap_or(0) == 0)
    }

    /// Keeps only the slots that are also in `other`.
    pub(crate) fn intersect_with(&mut self, other: &Self) {
        for (i, word) in self.words.iter_mut().enumerate() {
            *word &= other.words.get(i).copied().unwrap_or(0);
        }
    }

    /// Calls `f` for each slot of `self` that is not in `other`, ascending.
    pub(crate) fn for_each_not_in(&self, other: &Self, mut f: impl FnMut(u32)) {
        for (i, &word) in self.words.iter().enumerate() {
            let mut rest = word & !other.words.get(i).copied().unwrap_or(0);
            while rest != 0 {
                // `i` indexes a word of a set of u32 slots, so `i * 64` fits in a u32.
                f(i as u32 * 64 + rest.trailing_zeros());
                rest &= rest - 1;
            }
        }
    }

    /// The slots, ascending.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &word)| {
            let mut rest = word;
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let bit = rest.trailing_zeros();
                rest &= rest - 1;
                Some(i as u32 * 64 + bit)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(slots: &[u32]) -> SlotBits {
        let mut set = SlotBits::default();
        for &slot in slots {
            set.insert(slot);
        }
        set
    }

    #[test]
    fn set_operations_across_words() {
        let a = bits(&[0, 63, 64, 200]);
        let b = bits(&[63, 200]);
        assert!(b.is_subset_of(&a));
        assert!(!a.is_subset_of(&b));
        assert!(bits(&[]).is_subset_of(&b));
        let mut dropped = Vec::new();
        a.for_each_not_in(&b, |slot| dropped.push(slot));
        assert_eq!(dropped, vec![0, 64]);
        let mut c = a.clone();
        c.intersect_with(&bits(&[64]));
        assert_eq!(c.iter().collect::<Vec<_>>(), vec![64]);
        assert!(c.contains(64) && !c.contains(0) && !c.contains(1000));
        c.clear();
        assert!(c.is_empty());
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![0, 63, 64, 200]);
        assert_eq!(a.len(), 4);
    }

    #[test]
    fn union_and_remove() {
        let mut a = bits(&[1]);
        a.union_with(&bits(&[2, 300]));
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![1, 2, 300]);
        assert!(a.remove(300));
        assert!(!a.remove(300));
        assert!(!a.remove(5000));
        assert_eq!(a.len(), 2);
    }
}

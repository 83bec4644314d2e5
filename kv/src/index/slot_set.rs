//! The holders of one block: a few slots inline, or a bitset once more workers share it.

use super::slot_bits::SlotBits;

/// Slots stored without a heap allocation.
pub(crate) const INLINE: usize = 3;

/// Slot numbers (dense worker ids) of the workers holding one block.
///
/// Most blocks are held by one or a few workers, so up to [`INLINE`] slots live inline (the
/// whole set is 16 bytes). Blocks shared more widely (system prompts) switch to a bitset, so a
/// lookup copies their holders word by word instead of slot by slot.
#[derive(Debug, Clone)]
pub(crate) enum SlotSet {
    /// Up to [`INLINE`] slots stored in place; `len` of them are valid.
    Inline { len: u8, slots: [u32; INLINE] },
    /// More slots than fit inline, as bits.
    Shared(Box<SlotBits>),
}

impl Default for SlotSet {
    fn default() -> Self {
        Self::Inline {
            len: 0,
            slots: [0; INLINE],
        }
    }
}

impl SlotSet {
    /// Heap bytes the set owns beyond its own size.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Self::Inline { .. } => 0,
            Self::Shared(bits) => std::mem::size_of::<SlotBits>() + bits.heap_bytes(),
        }
    }

    /// A set holding only `slot`.
    pub(crate) fn one(slot: u32) -> Self {
        Self::Inline {
            len: 1,
            slots: [slot, 0, 0],
        }
    }

    /// The only slot of a one-slot set.
    pub(crate) fn single(&self) -> Option<u32> {
        match self {
            Self::Inline { len: 1, slots } => Some(slots[0]),
            _ => None,
        }
    }

    /// Whether `slot` is in the set.
    pub(crate) fn contains(&self, slot: u32) -> bool {
        match self {
            Self::Inline { len, slots } => slots[..usize::from(*len)].contains(&slot),
            Self::Shared(bits) => bits.contains(slot),
        }
    }

    /// Adds every slot of the set to `bits`.
    pub(crate) fn add_to(&self, bits: &mut SlotBits) {
        match self {
            Self::Inline { len, slots } => {
                for &slot in &slots[..usize::from(*len)] {
                    bits.insert(slot);
                }
            }
            Self::Shared(shared) => bits.union_with(shared),
        }
    }

    /// Adds `slot`; returns false when it was already present.
    pub(crate) fn insert(&mut self, slot: u32) -> bool {
        if self.contains(slot) {
            return false;
        }
        match self {
            Self::Inline { len, slots } => {
                let n = usize::from(*len);
                if n < INLINE {
                    slots[n] = slot;
                    *len += 1;
                } else {
                    let mut bits = SlotBits::default();
                    for &s in slots.iter() {
                        bits.insert(s);
                    }
                    bits.insert(slot);
                    *self = Self::Shared(Box::new(bits));
                }
            }
            Self::Shared(bits) => bits.insert(slot),
        }
        true
    }

    /// Removes `slot`; returns false when it was absent.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        match self {
            Self::Inline { len, slots } => {
                let n = usize::from(*len);
                let Some(at) = slots[..n].iter().position(|&s| s == slot) else {
                    return false;
                };
                slots[at] = slots[n - 1];
                *len -= 1;
                true
            }
            Self::Shared(bits) => {
                if !bits.remove(slot) {
                    return false;
                }
                if bits.len() <= INLINE {
                    let mut inline = [0u32; INLINE];
                    let mut len = 0u8;
                    for (at, s) in bits.iter().enumerate() {
                        inline[at] = s;
                        len += 1;
                    }
                    *self = Self::Inline { len, slots: inline };
                }
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(set: &SlotSet) -> Vec<u32> {
        let mut bits = SlotBits::default();
        set.add_to(&mut bits);
        bits.iter().collect()
    }

    #[test]
    fn grows_past_inline_and_shrinks_back() {
        let mut set = SlotSet::one(5);
        for slot in [1, 900, 3, 7] {
            assert!(set.insert(slot));
        }
        assert!(!set.insert(900));
        assert!(matches!(set, SlotSet::Shared(_)));
        assert_eq!(members(&set), vec![1, 3, 5, 7, 900]);
        assert!(set.remove(5));
        assert!(!set.remove(5));
        assert!(set.remove(1));
        assert!(matches!(set, SlotSet::Inline { .. }));
        assert_eq!(members(&set), vec![3, 7, 900]);
        for slot in [3, 7, 900] {
            assert!(set.contains(slot));
            assert!(set.remove(slot));
        }
        assert!(members(&set).is_empty());
        assert!(!set.contains(3));
    }

    #[test]
    fn stays_small() {
        assert_eq!(size_of::<SlotSet>(), 16);
    }
}

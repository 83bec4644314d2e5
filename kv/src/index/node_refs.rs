//! The reference counts of one block in one worker, and their packed 4-byte form.

/// Reference counts of one block in one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct NodeRefs {
    /// Engine ids of this worker that map to the block, its own id included; held while
    /// non-zero.
    pub(crate) refs: u32,
    /// Held blocks of this worker whose parent is this block.
    pub(crate) children: u32,
    /// Whether the block's own id maps to it: the engine id equal to its sequence hash, which
    /// is how the worker-agent names blocks. That id has no entry in the worker's engine-id
    /// table; this flag is its entry.
    pub(crate) own: bool,
}

/// [`NodeRefs`] in 4 bytes: `refs` holds the count in its low 15 bits and [`NodeRefs::own`]
/// in its top bit; `children` is the count. The default (all zero) is "no counts".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PackedRefs {
    refs: u16,
    children: u16,
}

/// The bit of [`PackedRefs::refs`] that holds [`NodeRefs::own`].
const OWN: u16 = 1 << 15;

impl PackedRefs {
    /// No counts.
    pub(crate) const ZERO: Self = Self {
        refs: 0,
        children: 0,
    };

    /// A value no [`PackedRefs::pack`] returns, for callers that keep counts that do not fit
    /// elsewhere and need a marker in their place.
    pub(crate) const WIDE: Self = Self {
        refs: u16::MAX,
        children: u16::MAX,
    };

    /// `node` packed, or `None` when its counts do not fit.
    pub(crate) fn pack(node: NodeRefs) -> Option<Self> {
        let refs = u16::try_from(node.refs).ok().filter(|&r| r < OWN)?;
        let children = u16::try_from(node.children).ok()?;
        let packed = Self {
            refs: refs | if node.own { OWN } else { 0 },
            children,
        };
        (packed != Self::WIDE).then_some(packed)
    }

    /// The counts this packs (not for [`PackedRefs::WIDE`]).
    pub(crate) fn unpack(self) -> NodeRefs {
        NodeRefs {
            refs: u32::from(self.refs & !OWN),
            children: u32::from(self.children),
            own: self.refs & OWN != 0,
        }
    }

    /// Whether the packed counts hold the block (a non-zero `refs` count).
    pub(crate) fn holds(self) -> bool {
        self.refs & !OWN != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_round_trip_until_they_do_not_fit() {
        for node in [
            NodeRefs::default(),
            NodeRefs {
                refs: 1,
                children: 0,
                own: true,
            },
            NodeRefs {
                refs: 32_767,
                children: 65_535,
                own: false,
            },
        ] {
            let packed = PackedRefs::pack(node).expect("fits");
            assert_eq!(packed.unpack(), node);
            assert_eq!(packed.holds(), node.refs > 0);
        }
        let too_many_refs = NodeRefs {
            refs: 32_768,
            ..NodeRefs::default()
        };
        assert_eq!(PackedRefs::pack(too_many_refs), None);
        let wide = NodeRefs {
            refs: 32_767,
            children: 65_535,
            own: true,
        };
        assert_eq!(PackedRefs::pack(wide), None, "the marker's bits");
    }
}

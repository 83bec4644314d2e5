//! KV cache events in kvmesh's block-hash space, as the index applies them.
//!
//! The worker-agent re-hashes every stored block from its token ids, so an event names each
//! block three ways: the engine's opaque id (used to address later removals), kvmesh's local
//! hash and kvmesh's sequence hash (the block's identity in the index). A Stored event's parent
//! is named both ways too, so the index can place the blocks even when it never saw the parent.

use crate::hash::{ExternalHash, LocalBlockHash, SequenceHash, sequence_hash};

/// One block of a [`KvEvent::Stored`] event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The id later [`KvEvent::Removed`] events name the block by. The worker-agent sends the
    /// block's own sequence hash (which the index stores for free); any other 64-bit id per
    /// engine block works too.
    pub external: ExternalHash,
    /// kvmesh's local hash of the block's tokens.
    pub local: LocalBlockHash,
    /// kvmesh's sequence hash: `sequence_hash(previous block's sequence hash, local)`.
    pub sequence: SequenceHash,
}

/// The block a [`KvEvent::Stored`] chain continues from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockParent {
    /// The engine's id of the parent block.
    pub external: ExternalHash,
    /// kvmesh's sequence hash of the parent block.
    pub sequence: SequenceHash,
}

impl BlockParent {
    /// The block `sequence` as a parent, named by its own id ([`ExternalHash::own`]).
    pub fn own(sequence: SequenceHash) -> Self {
        Self {
            external: ExternalHash::own(sequence),
            sequence,
        }
    }
}

/// A change to one worker's KV cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// The worker cached a chain of blocks, each the child of the one before it.
    Stored {
        /// The block before `blocks[0]`; `None` when the chain starts a sequence.
        parent: Option<BlockParent>,
        /// The stored blocks, parent first.
        blocks: Vec<StoredBlock>,
    },
    /// The worker evicted these blocks (by engine id). Descendants are not implied.
    Removed {
        /// Engine ids of the evicted blocks.
        blocks: Vec<ExternalHash>,
    },
    /// The worker instance dropped its whole cache, on every data-parallel rank.
    Cleared,
}

impl KvEvent {
    /// A Stored event for a chain of blocks given as (engine id, local hash), parent first;
    /// the sequence hashes are chained from `parent`'s.
    pub fn stored(
        parent: Option<BlockParent>,
        blocks: impl IntoIterator<Item = (ExternalHash, LocalBlockHash)>,
    ) -> Self {
        let mut previous = parent.map(|p| p.sequence);
        let blocks = blocks
            .into_iter()
            .map(|(external, local)| {
                let sequence = sequence_hash(previous, local);
                previous = Some(sequence);
                StoredBlock {
                    external,
                    local,
                    sequence,
                }
            })
            .collect();
        Self::Stored { parent, blocks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_chains_sequence_hashes_from_the_parent() {
        let parent = BlockParent {
            external: ExternalHash(9),
            sequence: SequenceHash(77),
        };
        let event = KvEvent::stored(
            Some(parent),
            [
                (ExternalHash(1), LocalBlockHash(10)),
                (ExternalHash(2), LocalBlockHash(20)),
            ],
        );
        let KvEvent::Stored { parent: p, blocks } = event else {
            panic!("not a Stored event");
        };
        assert_eq!(p, Some(parent));
        let first = sequence_hash(Some(SequenceHash(77)), LocalBlockHash(10));
        assert_eq!(blocks[0].sequence, first);
        assert_eq!(
            blocks[1].sequence,
            sequence_hash(Some(first), LocalBlockHash(20))
        );
    }
}

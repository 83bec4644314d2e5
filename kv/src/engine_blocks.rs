//! Turning an engine's block events (opaque engine ids + token ids) into index events in
//! kvmesh's hash space: the translation the worker-agent (or any event intake) performs.

use std::collections::HashMap;

use thiserror::Error;

use crate::event::{BlockParent, KvEvent, StoredBlock};
use crate::hash::{
    BlockHasher, ExternalHash, LocalBlockHash, SequenceHash, apply_cache_salt, sequence_hash,
};
use crate::keyed_hasher::KeyedState;

/// An engine event that cannot be translated into kvmesh's hash space.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TranslateError {
    /// The event's parent block was never reported (or was removed): events were missed.
    #[error("parent block {0:?} is unknown for this worker")]
    UnknownParent(ExternalHash),
    /// The token ids do not fill exactly one block per block id.
    #[error("{tokens} tokens for {blocks} blocks of {block_size} tokens")]
    TokenCount {
        /// Block ids in the event.
        blocks: usize,
        /// Token ids in the event.
        tokens: usize,
        /// The hasher's block size.
        block_size: usize,
    },
}

/// One worker's engine block id → kvmesh sequence hash map, kept in step with its events.
///
/// Engines name blocks by their own opaque ids; the index needs kvmesh's sequence hashes, which
/// chain from the parent's. This map remembers the sequence hash of every block the engine
/// reported, so a Stored event can be re-hashed from its tokens and chained to its parent.
/// Use one per worker key, and feed it that worker's events in order.
///
/// Its events name blocks by the engine's ids, which the index keeps in a table (about 20 bytes
/// per (worker, block) pair). The worker-agent instead names each block by its own sequence
/// hash and counts the engine ids per block itself, which the index stores for free.
#[derive(Debug, Clone, Default)]
pub struct EngineBlockMap {
    blocks: HashMap<ExternalHash, SequenceHash, KeyedState>,
    locals: Vec<LocalBlockHash>,
}

impl EngineBlockMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of engine blocks known.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no engine block is known.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The sequence hash of an engine block, if known.
    pub fn sequence_of(&self, block: ExternalHash) -> Option<SequenceHash> {
        self.blocks.get(&block).copied()
    }

    /// Translates an engine's "blocks stored" event: `block_ids[i]` holds tokens
    /// `tokens[i*bs .. (i+1)*bs]` and follows engine block `parent` (`None`: starts a sequence).
    ///
    /// Fails, changing nothing, when the parent is unknown (events were missed: resynchronise)
    /// or when the token count is not `block_ids.len() × block_size`.
    pub fn stored(
        &mut self,
        hasher: &mut BlockHasher,
        parent: Option<ExternalHash>,
        block_ids: &[ExternalHash],
        tokens: &[u32],
    ) -> Result<KvEvent, TranslateError> {
        self.stored_mm::<&[u64]>(hasher, parent, block_ids, tokens, &[])
    }

    /// Like [`EngineBlockMap::stored`], where block `i` carries the multimodal object hashes
    /// `mm_hashes[i]` (see [`BlockHasher::extend_local_hashes_mm`]).
    pub fn stored_mm<M: AsRef<[u64]>>(
        &mut self,
        hasher: &mut BlockHasher,
        parent: Option<ExternalHash>,
        block_ids: &[ExternalHash],
        tokens: &[u32],
        mm_hashes: &[M],
    ) -> Result<KvEvent, TranslateError> {
        self.stored_salted(hasher, parent, block_ids, tokens, mm_hashes, None)
    }

    /// Like [`EngineBlockMap::stored_mm`], for blocks of a request with `cache_salt`: when the
    /// event starts a sequence (`parent` `None`), its first block is salted as
    /// [`BlockHasher::hash_salted_into`] salts a request's (see [`crate::salted_local_hash`]);
    /// after a parent the salt is already in the parent's sequence hash and is not applied.
    pub fn stored_salted<M: AsRef<[u64]>>(
        &mut self,
        hasher: &mut BlockHasher,
        parent: Option<ExternalHash>,
        block_ids: &[ExternalHash],
        tokens: &[u32],
        mm_hashes: &[M],
        cache_salt: Option<&str>,
    ) -> Result<KvEvent, TranslateError> {
        if tokens.len() != block_ids.len() * hasher.block_size() {
            return Err(TranslateError::TokenCount {
                blocks: block_ids.len(),
                tokens: tokens.len(),
                block_size: hasher.block_size(),
            });
        }
        let parent = match parent {
            None => None,
            Some(id) => Some(BlockParent {
                external: id,
                sequence: self
                    .sequence_of(id)
                    .ok_or(TranslateError::UnknownParent(id))?,
            }),
        };
        self.locals.clear();
        hasher.extend_local_hashes_mm(tokens, mm_hashes, &mut self.locals);
        if parent.is_none() {
            apply_cache_salt(&mut self.locals, cache_salt);
        }
        let mut previous = parent.map(|p| p.sequence);
        let mut blocks = Vec::with_capacity(block_ids.len());
        for (&external, &local) in block_ids.iter().zip(&self.locals) {
            let sequence = sequence_hash(previous, local);
            self.blocks.insert(external, sequence);
            blocks.push(StoredBlock {
                external,
                local,
                sequence,
            });
            previous = Some(sequence);
        }
        Ok(KvEvent::Stored { parent, blocks })
    }

    /// Translates an engine's "blocks removed" event, forgetting the blocks.
    pub fn removed(&mut self, block_ids: &[ExternalHash]) -> KvEvent {
        for id in block_ids {
            self.blocks.remove(id);
        }
        KvEvent::Removed {
            blocks: block_ids.to_vec(),
        }
    }

    /// Translates an engine's "all blocks cleared" event, forgetting every block.
    pub fn cleared(&mut self) -> KvEvent {
        self.blocks.clear();
        KvEvent::Cleared
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::KvIndex;
    use crate::worker::WorkerKey;

    const W: WorkerKey = WorkerKey::new(7, 0);

    #[test]
    fn engine_events_become_index_events_matching_request_hashes() {
        let mut hasher = BlockHasher::new(4, None).expect("block size");
        let tokens: Vec<u32> = (0..16).collect();
        let request = hasher.hash(&tokens);
        let mut map = EngineBlockMap::new();
        let index = KvIndex::new();
        let first = map
            .stored(
                &mut hasher,
                None,
                &[ExternalHash(900), ExternalHash(901)],
                &tokens[..8],
            )
            .expect("root chain");
        let second = map
            .stored(
                &mut hasher,
                Some(ExternalHash(901)),
                &[ExternalHash(902), ExternalHash(903)],
                &tokens[8..],
            )
            .expect("known parent");
        assert_eq!(index.apply(W, &first).blocks_stored, 2);
        assert_eq!(index.apply(W, &second).status(), crate::ApplyStatus::Ok);
        assert_eq!(index.find_matches(&request.sequence).depth(W), 4);
        assert_eq!(
            map.sequence_of(ExternalHash(903)),
            Some(request.sequence[3])
        );

        let removed = map.removed(&[ExternalHash(902)]);
        assert_eq!(index.apply(W, &removed).blocks_removed, 1);
        assert_eq!(index.find_matches(&request.sequence).depth(W), 2);
        assert_eq!(map.len(), 3);
        assert_eq!(map.cleared(), KvEvent::Cleared);
        assert!(map.is_empty());
    }

    #[test]
    fn unknown_parent_and_bad_token_counts_are_errors() {
        let mut hasher = BlockHasher::new(4, None).expect("block size");
        let mut map = EngineBlockMap::new();
        assert_eq!(
            map.stored(
                &mut hasher,
                Some(ExternalHash(1)),
                &[ExternalHash(2)],
                &[0, 1, 2, 3]
            ),
            Err(TranslateError::UnknownParent(ExternalHash(1)))
        );
        assert_eq!(
            map.stored(&mut hasher, None, &[ExternalHash(2)], &[0, 1, 2]),
            Err(TranslateError::TokenCount {
                blocks: 1,
                tokens: 3,
                block_size: 4
            })
        );
        assert!(map.is_empty());
    }

    #[test]
    fn salted_blocks_hash_like_salted_requests() {
        let mut hasher = BlockHasher::new(4, None).expect("block size");
        let tokens: Vec<u32> = (0..12).collect();
        let request = hasher.hash_salted(&tokens, Some("tenant-a"));
        let mut map = EngineBlockMap::new();
        let none: &[&[u64]] = &[];
        let root = map
            .stored_salted(
                &mut hasher,
                None,
                &[ExternalHash(1), ExternalHash(2)],
                &tokens[..8],
                none,
                Some("tenant-a"),
            )
            .expect("root chain");
        // A continuation names the salt too (vLLM's extra keys do not, kvmesh's intake may):
        // it is already in the parent's hash and must not be applied twice.
        let tail = map
            .stored_salted(
                &mut hasher,
                Some(ExternalHash(2)),
                &[ExternalHash(3)],
                &tokens[8..],
                none,
                Some("tenant-a"),
            )
            .expect("known parent");
        let index = KvIndex::new();
        index.apply(W, &root);
        assert_eq!(index.apply(W, &tail).status(), crate::ApplyStatus::Ok);
        assert_eq!(index.find_matches(&request.sequence).depth(W), 3);
        let other = hasher.hash_salted(&tokens, Some("tenant-b"));
        assert_eq!(index.find_matches(&other.sequence).depth(W), 0);
        assert_eq!(
            index.find_matches(&hasher.hash(&tokens).sequence).depth(W),
            0
        );
    }

    #[test]
    fn multimodal_blocks_hash_like_requests() {
        let mut hasher = BlockHasher::new(4, None).expect("block size");
        let tokens: Vec<u32> = (0..8).collect();
        let mm = [vec![], vec![42u64]];
        let mut request = crate::hash::BlockHashes::default();
        hasher.hash_mm_into(&tokens, &mm, &mut request);
        let mut map = EngineBlockMap::new();
        let event = map
            .stored_mm(
                &mut hasher,
                None,
                &[ExternalHash(1), ExternalHash(2)],
                &tokens,
                &mm,
            )
            .expect("root chain");
        let KvEvent::Stored { blocks, .. } = event else {
            panic!("not a Stored event");
        };
        let sequences: Vec<SequenceHash> = blocks.iter().map(|b| b.sequence).collect();
        assert_eq!(sequences, request.sequence);
    }
}

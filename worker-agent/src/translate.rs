//! Translation of one data-parallel rank's engine events into kvmesh's hash space.
//!
//! Each stored block is re-hashed from its token ids with `kvmesh_kv::BlockHasher` (LoRA seed
//! and multimodal hashes included; an event that starts a sequence salts its first block with
//! the request's `cache_salt`, as the proxy salts the request's) and chained onto its parent's
//! sequence hash. The table keeps, per engine block id, its parent, local and sequence hashes
//! and a reference count: vLLM may store the same block twice, and only the last matching
//! removal evicts it. The table is also the source of full snapshots.

use std::collections::HashMap;

use kvmesh_kv::{
    BlockHasher, BlockParent, ExternalHash, HashError, KvEvent, LocalBlockHash, SequenceHash,
    StoredBlock, apply_cache_salt, sequence_hash,
};

/// What a stored block is known as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockInfo {
    parent: Option<BlockParent>,
    local: LocalBlockHash,
    sequence: SequenceHash,
    refs: u32,
}

/// Why an engine event produced nothing (or less than it named).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// A Stored event's parent block is unknown (events before the agent's start or lost):
    /// its blocks cannot be placed.
    UnknownParent,
    /// The event's block size differs from the configured one.
    BlockSize,
    /// `token_ids` does not hold exactly one block of tokens per block hash.
    TokenCount,
}

/// One rank's engine block table.
#[derive(Debug)]
pub struct RankTable {
    block_size: usize,
    base: BlockHasher,
    lora: HashMap<String, BlockHasher>,
    blocks: HashMap<ExternalHash, BlockInfo>,
    locals: Vec<LocalBlockHash>,
}

impl RankTable {
    /// An empty table for blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Result<Self, HashError> {
        Ok(Self {
            block_size,
            base: BlockHasher::new(block_size, None)?,
            lora: HashMap::new(),
            blocks: HashMap::new(),
            locals: Vec::new(),
        })
    }

    /// Number of engine blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    fn hasher(&mut self, lora: Option<&str>) -> Result<&mut BlockHasher, HashError> {
        match lora {
            None => Ok(&mut self.base),
            Some(name) => {
                if !self.lora.contains_key(name) {
                    let hasher = BlockHasher::new(self.block_size, Some(name))?;
                    self.lora.insert(name.to_owned(), hasher);
                }
                // Just inserted or already there.
                self.lora.get_mut(name).ok_or(HashError::ZeroBlockSize)
            }
        }
    }

    /// Translates a store of `block_ids` (parent first) holding `tokens`, after `parent`.
    /// Appends the Stored events for blocks not held yet (a chain split where already-held
    /// blocks sit) to `out`; already-held blocks only gain a reference. Fails, changing
    /// nothing, on an unknown parent or a size mismatch. `cache_salt` salts the first block
    /// when there is no parent (after one, the parent's hash already carries it).
    #[allow(clippy::too_many_arguments)]
    pub fn stored(
        &mut self,
        parent: Option<u64>,
        block_ids: &[u64],
        tokens: &[u32],
        block_size: usize,
        lora: Option<&str>,
        mm_hashes: &[Vec<u64>],
        cache_salt: Option<&str>,
        out: &mut Vec<KvEvent>,
    ) -> Result<(), Miss> {
        if block_size != self.block_size {
            return Err(Miss::BlockSize);
        }
        if tokens.len() != block_ids.len() * block_size {
            return Err(Miss::TokenCount);
        }
        let parent = match parent {
            None => None,
            Some(id) => {
                let external = ExternalHash(id);
                let info = self.blocks.get(&external).ok_or(Miss::UnknownParent)?;
                Some(BlockParent {
                    external,
                    sequence: info.sequence,
                })
            }
        };
        let mut locals = std::mem::take(&mut self.locals);
        locals.clear();
        let hashed = self.hasher(lora).map(|hasher| {
            if mm_hashes.is_empty() {
                hasher.extend_local_hashes(tokens, &mut locals);
            } else {
                hasher.extend_local_hashes_mm(tokens, mm_hashes, &mut locals);
            }
        });
        if hashed.is_err() {
            self.locals = locals;
            return Err(Miss::BlockSize);
        }
        if parent.is_none() {
            apply_cache_salt(&mut locals, cache_salt);
        }
        let mut previous = parent;
        let mut run_parent = parent;
        let mut run: Vec<StoredBlock> = Vec::new();
        for (&id, &local) in block_ids.iter().zip(&locals) {
            let external = ExternalHash(id);
            let sequence = sequence_hash(previous.map(|p| p.sequence), local);
            let info = BlockInfo {
                parent: previous,
                local,
                sequence,
                refs: 1,
            };
            let this = Some(BlockParent { external, sequence });
            match self.blocks.get_mut(&external) {
                Some(held) if held.sequence == sequence => {
                    held.refs = held.refs.saturating_add(1);
                    if !run.is_empty() {
                        out.push(KvEvent::Stored {
                            parent: run_parent,
                            blocks: std::mem::take(&mut run),
                        });
                    }
                    run_parent = this;
                }
                held => {
                    // A new block, or an engine id reused for other content: (re)place it.
                    match held {
                        Some(h) => *h = info,
                        None => {
                            self.blocks.insert(external, info);
                        }
                    }
                    run.push(StoredBlock {
                        external,
                        local,
                        sequence,
                    });
                }
            }
            previous = this;
        }
        if !run.is_empty() {
            out.push(KvEvent::Stored {
                parent: run_parent,
                blocks: run,
            });
        }
        self.locals = locals;
        Ok(())
    }

    /// Translates a removal: each block loses a reference and is evicted at zero. Appends a
    /// Removed event for the evicted ones to `out`; returns how many ids were unknown.
    pub fn removed(&mut self, block_ids: &[u64], out: &mut Vec<KvEvent>) -> usize {
        let mut unknown = 0;
        let mut evicted = Vec::new();
        for &id in block_ids {
            let external = ExternalHash(id);
            match self.blocks.get_mut(&external) {
                Some(info) if info.refs > 1 => info.refs -= 1,
                Some(_) => {
                    self.blocks.remove(&external);
                    evicted.push(external);
                }
                None => unknown += 1,
            }
        }
        if !evicted.is_empty() {
            out.push(KvEvent::Removed { blocks: evicted });
        }
        unknown
    }

    /// Forgets every block. With `instance_wide` the event is a Cleared (the instance has only
    /// this rank); otherwise a Removed of every block, so the other ranks are untouched.
    pub fn cleared(&mut self, instance_wide: bool, out: &mut Vec<KvEvent>) {
        if instance_wide {
            self.blocks.clear();
            out.push(KvEvent::Cleared);
            return;
        }
        let blocks: Vec<ExternalHash> = self.blocks.drain().map(|(id, _)| id).collect();
        if !blocks.is_empty() {
            out.push(KvEvent::Removed { blocks });
        }
    }

    /// The whole table as Stored events, parents before children, linear chains merged into
    /// one event. A block whose parent was evicted still names it (it stays an orphan at the
    /// receiver, as in the engine's own event history).
    pub fn snapshot(&self) -> Vec<KvEvent> {
        let mut children: HashMap<ExternalHash, Vec<ExternalHash>> = HashMap::new();
        let mut roots = Vec::new();
        for (&id, info) in &self.blocks {
            match info.parent {
                Some(p) if self.blocks.contains_key(&p.external) => {
                    children.entry(p.external).or_default().push(id);
                }
                _ => roots.push(id),
            }
        }
        roots.sort_unstable();
        for list in children.values_mut() {
            list.sort_unstable();
        }
        let mut events = Vec::new();
        let mut stack: Vec<ExternalHash> = roots.into_iter().rev().collect();
        let mut current: Option<(Option<BlockParent>, Vec<StoredBlock>)> = None;
        while let Some(id) = stack.pop() {
            let Some(info) = self.blocks.get(&id) else {
                continue;
            };
            let block = StoredBlock {
                external: id,
                local: info.local,
                sequence: info.sequence,
            };
            let continues = match (&current, info.parent) {
                (Some((_, blocks)), Some(p)) => {
                    blocks.last().map(|b| b.external) == Some(p.external)
                }
                _ => false,
            };
            if continues {
                if let Some((_, blocks)) = current.as_mut() {
                    blocks.push(block);
                }
            } else {
                if let Some((parent, blocks)) = current.take() {
                    events.push(KvEvent::Stored { parent, blocks });
                }
                current = Some((info.parent, vec![block]));
            }
            if let Some(kids) = children.get(&id) {
                stack.extend(kids.iter().rev());
            }
        }
        if let Some((parent, blocks)) = current {
            events.push(KvEvent::Stored { parent, blocks });
        }
        events
    }
}

#[cfg(test)]
mod tests;

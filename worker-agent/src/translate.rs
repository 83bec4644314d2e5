//! Translation of one data-parallel rank's engine events into kvmesh's hash space.
//!
//! Each stored block is re-hashed from its token ids with `kvmesh_kv::BlockHasher` (LoRA seed
//! and multimodal hashes included; an event that starts a sequence salts its first block with
//! the request's `cache_salt`, as the proxy salts the request's) and chained onto its parent's
//! sequence hash. The table keeps, per engine block id, its parent, local and sequence hashes
//! and a reference count: vLLM may store the same block twice, and only the last matching
//! removal evicts it. The table is also the source of full snapshots.
//!
//! The events sent name every block by its own sequence hash, not by the engine's id
//! ([`ExternalHash::own`]): the proxy's index then needs no engine id → block table (a third of its
//! memory per block). So the agent keeps that table (above) and, per tier, how many engine ids
//! map to each sequence hash ([`SequenceRefs`]): a block is sent as stored when its first id
//! appears and as removed when its last goes, whatever ids the engine used.
//!
//! Blocks an offloading connector keeps in host memory or on disk are named by the engine ids
//! their device copies had (vLLM's offload events carry those ids; their tokens, when sent,
//! lack the salt and adapter the device's events carry), so a lower tier takes each block's
//! hashes from the device table (or another tier) where the engine stored it first. A tier
//! whose engine never reports evictions (vLLM's disk stores) is bounded: past
//! [`MAX_TIER_BLOCKS`] its oldest blocks are dropped.

use std::collections::{HashMap, HashSet, VecDeque};

use kvmesh_kv::{
    BlockHasher, BlockParent, CacheTier, ExternalHash, HashError, KvEvent, LocalBlockHash,
    SequenceHash, StoredBlock, apply_cache_salt, sequence_hash,
};

/// Blocks one rank keeps in one lower tier before its oldest are dropped.
pub const MAX_TIER_BLOCKS: usize = 1 << 20;

/// What a stored block is known as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockInfo {
    parent: Option<BlockParent>,
    local: LocalBlockHash,
    sequence: SequenceHash,
    refs: u32,
}

/// How many engine ids of one tier map to each sequence hash.
#[derive(Debug, Default)]
struct SequenceRefs(HashMap<SequenceHash, u32>);

impl SequenceRefs {
    /// One more engine id maps to `sequence`; true when it is the first.
    fn gain(&mut self, sequence: SequenceHash) -> bool {
        let refs = self.0.entry(sequence).or_insert(0);
        *refs += 1;
        *refs == 1
    }

    /// One engine id less maps to `sequence`; true when it was the last.
    fn lose(&mut self, sequence: SequenceHash) -> bool {
        match self.0.get_mut(&sequence) {
            Some(refs) if *refs > 1 => {
                *refs -= 1;
                false
            }
            Some(_) => {
                self.0.remove(&sequence);
                true
            }
            None => false,
        }
    }

    /// Forgets every block; returns their ids as sent.
    fn drain(&mut self) -> Vec<ExternalHash> {
        self.0
            .drain()
            .map(|(sequence, _)| ExternalHash::own(sequence))
            .collect()
    }
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

/// The blocks of one rank in one lower tier, oldest first for the bound.
#[derive(Debug, Default)]
struct TierTable {
    blocks: HashMap<ExternalHash, BlockInfo>,
    sequences: SequenceRefs,
    /// Engine ids in the order they were stored (ids removed since are skipped lazily).
    order: VecDeque<ExternalHash>,
}

/// One rank's engine block table.
#[derive(Debug)]
pub struct RankTable {
    block_size: usize,
    base: BlockHasher,
    lora: HashMap<String, BlockHasher>,
    blocks: HashMap<ExternalHash, BlockInfo>,
    /// The device's engine ids per sequence hash.
    sequences: SequenceRefs,
    /// Host memory, then disk.
    tiers: [TierTable; 2],
    max_tier_blocks: usize,
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
            sequences: SequenceRefs::default(),
            tiers: Default::default(),
            max_tier_blocks: MAX_TIER_BLOCKS,
            locals: Vec::new(),
        })
    }

    /// The table with each lower tier bounded to `max` blocks.
    pub fn with_max_tier_blocks(mut self, max: usize) -> Self {
        self.max_tier_blocks = max.max(1);
        self
    }

    /// Number of engine blocks held in device memory.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Number of engine blocks held in `tier`.
    pub fn tier_len(&self, tier: CacheTier) -> usize {
        match tier_slot(tier) {
            Some(slot) => self.tiers[slot].blocks.len(),
            None => self.blocks.len(),
        }
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
        let mut run_parent = parent.map(|p| BlockParent::own(p.sequence));
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
            let fresh = match self.blocks.get_mut(&external) {
                Some(held) if held.sequence == sequence => {
                    held.refs = held.refs.saturating_add(1);
                    false
                }
                Some(held) => {
                    // An engine id reused for other content leaves its old block, which goes
                    // when no other id holds it (sent before anything after it).
                    let old = std::mem::replace(held, info).sequence;
                    if self.sequences.lose(old) {
                        flush(out, run_parent, &mut run);
                        run_parent = previous.map(|p| BlockParent::own(p.sequence));
                        out.push(KvEvent::Removed {
                            blocks: vec![ExternalHash::own(old)],
                        });
                    }
                    self.sequences.gain(sequence)
                }
                None => {
                    self.blocks.insert(external, info);
                    self.sequences.gain(sequence)
                }
            };
            if fresh {
                run.push(StoredBlock {
                    external: ExternalHash::own(sequence),
                    local,
                    sequence,
                });
            } else {
                // Already held (under this id or another): the chain is split here.
                flush(out, run_parent, &mut run);
                run_parent = Some(BlockParent::own(sequence));
            }
            previous = Some(BlockParent { external, sequence });
        }
        flush(out, run_parent, &mut run);
        self.locals = locals;
        Ok(())
    }

    /// Translates a removal: each block loses a reference and is evicted at zero. Appends a
    /// Removed event for the evicted ones to `out`; returns how many ids were unknown.
    pub fn removed(&mut self, block_ids: &[u64], out: &mut Vec<KvEvent>) -> usize {
        release(&mut self.blocks, &mut self.sequences, block_ids, out)
    }

    /// Forgets every block, in every tier (vLLM's reset sends one `AllBlocksCleared` for
    /// all of them). With `instance_wide` the event is a Cleared (the instance has only this
    /// rank: the receiver drops all its tiers); otherwise a Removed of every block per tier
    /// (`out` by [`CacheTier`] order), so the other ranks are untouched.
    pub fn cleared(&mut self, instance_wide: bool, out: &mut [Vec<KvEvent>; 3]) {
        self.blocks.clear();
        let device = self.sequences.drain();
        let lower = self.tiers.each_mut().map(|tier| {
            tier.order.clear();
            tier.blocks.clear();
            tier.sequences.drain()
        });
        if instance_wide {
            out[0].push(KvEvent::Cleared);
            return;
        }
        for (out, blocks) in out
            .iter_mut()
            .zip([device, lower[0].clone(), lower[1].clone()])
        {
            if !blocks.is_empty() {
                out.push(KvEvent::Removed { blocks });
            }
        }
    }

    /// What is known of engine block `id`: from the device table, else a lower tier.
    fn known(&self, id: ExternalHash) -> Option<BlockInfo> {
        self.blocks
            .get(&id)
            .or_else(|| self.tiers.iter().find_map(|tier| tier.blocks.get(&id)))
            .copied()
    }

    /// Translates an offloading connector's store of `block_ids` into `tier` (a lower one):
    /// each block known from an earlier store (device or another tier) is kept there under
    /// the hashes it had, already-kept ones gain a reference; appends the Stored events
    /// (runs of blocks that continue each other) to `out` and drops the tier's oldest blocks
    /// past its bound (a Removed). Returns how many ids were unknown.
    pub fn tier_stored(
        &mut self,
        tier: CacheTier,
        block_ids: &[u64],
        out: &mut Vec<KvEvent>,
    ) -> usize {
        let Some(slot) = tier_slot(tier) else {
            return block_ids.len();
        };
        let mut unknown = 0;
        let mut run: Vec<StoredBlock> = Vec::new();
        let mut run_parent = None;
        for &id in block_ids {
            let external = ExternalHash(id);
            if let Some(held) = self.tiers[slot].blocks.get_mut(&external) {
                held.refs = held.refs.saturating_add(1);
                continue;
            }
            let Some(info) = self.known(external) else {
                unknown += 1;
                continue;
            };
            let table = &mut self.tiers[slot];
            table.blocks.insert(external, BlockInfo { refs: 1, ..info });
            table.order.push_back(external);
            if !table.sequences.gain(info.sequence) {
                // Already kept in this tier under another engine id.
                continue;
            }
            let continues = run.last().map(|b| b.sequence) == info.parent.map(|p| p.sequence);
            if !continues {
                flush(out, run_parent, &mut run);
            }
            if run.is_empty() {
                run_parent = info.parent.map(|p| BlockParent::own(p.sequence));
            }
            run.push(StoredBlock {
                external: ExternalHash::own(info.sequence),
                local: info.local,
                sequence: info.sequence,
            });
        }
        flush(out, run_parent, &mut run);
        let table = &mut self.tiers[slot];
        let mut dropped = Vec::new();
        while table.blocks.len() > self.max_tier_blocks {
            let Some(oldest) = table.order.pop_front() else {
                break;
            };
            if let Some(info) = table.blocks.remove(&oldest)
                && table.sequences.lose(info.sequence)
            {
                dropped.push(ExternalHash::own(info.sequence));
            }
        }
        if table.order.len() > 2 * table.blocks.len() + 1024 {
            let blocks = &table.blocks;
            table.order.retain(|id| blocks.contains_key(id));
        }
        if !dropped.is_empty() {
            out.push(KvEvent::Removed { blocks: dropped });
        }
        unknown
    }

    /// Translates a removal from lower tier `tier`: each block loses a reference and leaves
    /// at zero (a Removed appended to `out`); returns how many ids were unknown there.
    pub fn tier_removed(
        &mut self,
        tier: CacheTier,
        block_ids: &[u64],
        out: &mut Vec<KvEvent>,
    ) -> usize {
        let Some(slot) = tier_slot(tier) else {
            return block_ids.len();
        };
        let table = &mut self.tiers[slot];
        release(&mut table.blocks, &mut table.sequences, block_ids, out)
    }

    /// The device table as Stored events, parents before children, linear chains merged into
    /// one event. A block whose parent was evicted still names it (it stays an orphan at the
    /// receiver, as in the engine's own event history).
    pub fn snapshot(&self) -> Vec<KvEvent> {
        snapshot_of(&self.blocks)
    }

    /// Tier `tier`'s blocks as Stored events, as [`RankTable::snapshot`] gives the device's.
    pub fn tier_snapshot(&self, tier: CacheTier) -> Vec<KvEvent> {
        match tier_slot(tier) {
            Some(slot) => snapshot_of(&self.tiers[slot].blocks),
            None => self.snapshot(),
        }
    }
}

/// Sends `run` (when not empty) as one Stored event after `parent`, leaving it empty.
fn flush(out: &mut Vec<KvEvent>, parent: Option<BlockParent>, run: &mut Vec<StoredBlock>) {
    if !run.is_empty() {
        out.push(KvEvent::Stored {
            parent,
            blocks: std::mem::take(run),
        });
    }
}

/// Takes one reference off each of `block_ids` in `blocks`, evicting those left with none; a
/// block whose last engine id goes is sent as removed (appended to `out`). Returns how many
/// ids `blocks` did not hold.
fn release(
    blocks: &mut HashMap<ExternalHash, BlockInfo>,
    sequences: &mut SequenceRefs,
    block_ids: &[u64],
    out: &mut Vec<KvEvent>,
) -> usize {
    let mut unknown = 0;
    let mut evicted = Vec::new();
    for &id in block_ids {
        let external = ExternalHash(id);
        match blocks.get_mut(&external) {
            Some(info) if info.refs > 1 => info.refs -= 1,
            Some(info) => {
                let sequence = info.sequence;
                blocks.remove(&external);
                if sequences.lose(sequence) {
                    evicted.push(ExternalHash::own(sequence));
                }
            }
            None => unknown += 1,
        }
    }
    if !evicted.is_empty() {
        out.push(KvEvent::Removed { blocks: evicted });
    }
    unknown
}

/// The position of lower tier `tier` in [`RankTable`]'s tiers (`None`: the device).
fn tier_slot(tier: CacheTier) -> Option<usize> {
    match tier {
        CacheTier::Device => None,
        CacheTier::Host => Some(0),
        CacheTier::Disk => Some(1),
    }
}

/// `blocks` as Stored events, parents before children, linear chains merged into one event;
/// blocks named by their own ids ([`ExternalHash::own`]), each sequence hash once.
fn snapshot_of(blocks: &HashMap<ExternalHash, BlockInfo>) -> Vec<KvEvent> {
    let mut children: HashMap<ExternalHash, Vec<ExternalHash>> = HashMap::new();
    let mut roots = Vec::new();
    for (&id, info) in blocks {
        match info.parent {
            Some(p) if blocks.contains_key(&p.external) => {
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
    let mut sent = HashSet::new();
    while let Some(id) = stack.pop() {
        let Some(info) = blocks.get(&id) else {
            continue;
        };
        if let Some(kids) = children.get(&id) {
            stack.extend(kids.iter().rev());
        }
        if !sent.insert(info.sequence) {
            // Held under another engine id too, and sent already.
            continue;
        }
        let block = StoredBlock {
            external: ExternalHash::own(info.sequence),
            local: info.local,
            sequence: info.sequence,
        };
        let continues = match (&current, info.parent) {
            (Some((_, blocks)), Some(p)) => blocks.last().map(|b| b.sequence) == Some(p.sequence),
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
            current = Some((
                info.parent.map(|p| BlockParent::own(p.sequence)),
                vec![block],
            ));
        }
    }
    if let Some((parent, blocks)) = current {
        events.push(KvEvent::Stored { parent, blocks });
    }
    events
}

#[cfg(test)]
mod tests;

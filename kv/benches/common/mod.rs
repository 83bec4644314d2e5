//! Synthetic workloads shared by the benches: workers holding 512-block sequences that start
//! with one of 16 shared 64-block system prompts, and a query that matches the workers at
//! about ten different depths.

use kvmesh_kv::{
    BlockParent, ExternalHash, KvEvent, KvIndex, LocalBlockHash, SequenceHash, WorkerKey,
    extend_sequence_hashes,
};

/// Blocks per sequence (and per query).
pub const SEQUENCE_BLOCKS: usize = 512;
/// Blocks of each shared system prompt.
pub const PROMPT_BLOCKS: usize = 64;
/// Number of distinct system prompts.
pub const PROMPTS: u64 = 16;

/// A deterministic pseudo-random u64 from a seed (SplitMix64 finaliser).
pub fn mix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Local hashes of sequence `id`: prompt `prompt` followed by a tail unique to `id`.
pub fn sequence_locals(prompt: u64, id: u64, len: usize) -> Vec<LocalBlockHash> {
    (0..len as u64)
        .map(|i| {
            if i < PROMPT_BLOCKS as u64 {
                LocalBlockHash(mix(prompt << 32 | i))
            } else {
                LocalBlockHash(mix((id + 1) << 40 | i))
            }
        })
        .collect()
}

/// A Stored event for a whole chain (engine ids = sequence hashes), with its sequence hashes.
pub fn stored_chain(
    parent: Option<SequenceHash>,
    locals: &[LocalBlockHash],
) -> (KvEvent, Vec<SequenceHash>) {
    let mut sequence = Vec::new();
    extend_sequence_hashes(parent, locals, &mut sequence);
    let event = KvEvent::stored(
        parent.map(|s| BlockParent {
            external: ExternalHash(s.0),
            sequence: s,
        }),
        sequence
            .iter()
            .zip(locals)
            .map(|(s, &l)| (ExternalHash(s.0), l)),
    );
    (event, sequence)
}

/// Fills `index` with about `total_blocks` (worker, block) pairs over `workers` workers and
/// returns the 512-block query: worker 0 holds all of it, workers 1..=8 hold prefixes of
/// 64 + 48·k blocks, every worker whose sequences use prompt 0 holds its first 64 blocks.
pub fn populate(index: &KvIndex, workers: u64, total_blocks: usize) -> Vec<SequenceHash> {
    let per_worker = (total_blocks / workers as usize / SEQUENCE_BLOCKS).max(1) as u64;
    for w in 0..workers {
        let worker = WorkerKey::new(w, 0);
        for s in 0..per_worker {
            let id = w * per_worker + s;
            let locals = sequence_locals((w + s) % PROMPTS, id, SEQUENCE_BLOCKS);
            index.apply(worker, &stored_chain(None, &locals).0);
        }
    }
    let query_locals = sequence_locals(0, 0, SEQUENCE_BLOCKS);
    for k in 1..=8u64.min(workers - 1) {
        let depth = PROMPT_BLOCKS + 48 * k as usize;
        index.apply(
            WorkerKey::new(k, 0),
            &stored_chain(None, &query_locals[..depth]).0,
        );
    }
    stored_chain(None, &query_locals).1
}

/// Pre-built churn for write benches: `rounds` pairs of (Stored, Removed) events of
/// `blocks` blocks each, spread over churn workers, each chain continuing a shared prompt.
pub struct Churn {
    /// (worker, stored event, removed event) per round.
    pub rounds: Vec<(WorkerKey, KvEvent, KvEvent)>,
    /// Blocks per event.
    pub blocks: usize,
}

impl Churn {
    /// Builds the churn for workers `first_worker..first_worker + workers` (instance ids): the
    /// prompt prefix is stored once up front in `index` so every round's parent is known.
    pub fn new(
        index: &KvIndex,
        first_worker: u64,
        workers: u64,
        rounds: usize,
        blocks: usize,
    ) -> Self {
        let prompt = sequence_locals(0, 0, PROMPT_BLOCKS);
        let mut built = Vec::with_capacity(rounds);
        let mut parents = Vec::new();
        for w in 0..workers {
            let worker = WorkerKey::new(first_worker + w, 0);
            let (event, sequence) = stored_chain(None, &prompt);
            index.apply(worker, &event);
            parents.push((worker, sequence[PROMPT_BLOCKS - 1]));
        }
        for r in 0..rounds {
            let (worker, parent) = parents[r % parents.len()];
            let locals: Vec<LocalBlockHash> = (0..blocks as u64)
                .map(|i| LocalBlockHash(mix((first_worker + r as u64 + 1) << 44 | 1 << 43 | i)))
                .collect();
            let (stored, sequence) = stored_chain(Some(parent), &locals);
            let removed = KvEvent::Removed {
                blocks: sequence.iter().rev().map(|s| ExternalHash(s.0)).collect(),
            };
            built.push((worker, stored, removed));
        }
        Self {
            rounds: built,
            blocks,
        }
    }

    /// Applies round `r` (store then remove); returns the block-events applied.
    pub fn apply_round(&self, index: &KvIndex, r: usize) -> u64 {
        let (worker, stored, removed) = &self.rounds[r % self.rounds.len()];
        index.apply(*worker, stored);
        index.apply(*worker, removed);
        2 * self.blocks as u64
    }
}

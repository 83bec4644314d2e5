//! The host-memory tier behind the device cache, as vLLM's OffloadingConnector keeps it with
//! its CPU spec and one block per chunk (`vllm/v1/kv_offload/cpu/manager.py`,
//! `distributed/kv_transfer/kv_connector/v1/offloading/events.py`):
//!
//! - every block stored on the device is offloaded; one already there becomes the most recent
//!   and announces nothing;
//! - the tier is an LRU of a fixed number of blocks keyed by the block's sequence hash; the
//!   blocks of one iteration are offloaded together: first the least recently used blocks
//!   make room (one `BlockRemoved{medium: CPU}`, as vLLM's `prepare_store` evicts at once),
//!   then each new block gets its own `BlockStored{medium: CPU}`;
//! - a reset empties it without an event (vLLM's `CPUOffloadingManager.reset_cache`).

use std::collections::{HashMap, HashSet};

use super::lru::LruList;
use crate::config::OffloadEvents;
use crate::hashing::EngineHash;
use crate::kv_events::{EventBuffer, KvEvent, Medium};
use crate::lora::Lora;

/// One block waiting to be offloaded at the end of the iteration.
#[derive(Debug)]
struct Offload {
    hash: u64,
    engine_hash: EngineHash,
    /// Its `BlockStored{medium: CPU}`, in the configured form.
    event: KvEvent,
}

/// The host tier: `capacity` slots, an LRU over them and an index by sequence hash.
#[derive(Debug)]
pub(super) struct HostTier {
    form: OffloadEvents,
    /// Sequence hash and engine hash of each occupied slot.
    slots: Vec<(u64, EngineHash)>,
    free: Vec<u32>,
    lru: LruList,
    index: HashMap<u64, u32>,
    pending: Vec<Offload>,
    events: EventBuffer,
}

impl HostTier {
    /// An empty tier of `capacity` blocks (at least 1) announcing stores in `form`.
    pub(super) fn new(capacity: usize, form: OffloadEvents) -> Self {
        // Slot ids are u32, as the device pool's block ids.
        let capacity = capacity.clamp(1, u32::MAX as usize - 1);
        Self {
            form,
            slots: vec![(0, EngineHash::default()); capacity],
            free: (0..capacity as u32).rev().collect(),
            lru: LruList::new(capacity),
            index: HashMap::new(),
            pending: Vec::new(),
            events: EventBuffer::default(),
        }
    }

    /// Blocks held now.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// Number of leading `hashes` the tier holds.
    pub(super) fn lookup(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.index.contains_key(h))
            .count()
    }

    /// Makes the held blocks among `hashes` the most recently used.
    pub(super) fn touch(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(&slot) = self.index.get(h) {
                self.lru.remove(slot);
                self.lru.push_back(slot);
            }
        }
    }

    /// Queues a block just stored on the device (sequence hash `hash`, engine hash
    /// `engine_hash`, its `parent`, `tokens`, `block_size` and adapter `lora`) for offloading.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn queue(
        &mut self,
        hash: u64,
        engine_hash: EngineHash,
        parent: Option<EngineHash>,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&Lora>,
    ) {
        let event = match self.form {
            OffloadEvents::Placeholder => KvEvent::host_placeholder(engine_hash),
            OffloadEvents::SelfDescribing => KvEvent::BlockStored {
                block_hashes: vec![engine_hash],
                parent_block_hash: parent,
                token_ids: tokens.to_vec(),
                block_size,
                lora: lora.cloned(),
                cache_salt: None,
                medium: Medium::Cpu,
            },
        };
        self.pending.push(Offload {
            hash,
            engine_hash,
            event,
        });
    }

    /// Offloads the queued blocks: those already held become the most recent; the new ones
    /// evict the least recently used blocks they need room from (never a block of this
    /// batch), then are stored, each announced. New blocks beyond what the tier can take
    /// besides this batch's held ones are not offloaded.
    pub(super) fn offload_queued(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        let mut fresh: Vec<Offload> = Vec::with_capacity(pending.len());
        let mut seen = HashSet::with_capacity(pending.len());
        let mut held_in_batch = 0;
        for offload in pending {
            if !seen.insert(offload.hash) {
                continue;
            }
            if let Some(&slot) = self.index.get(&offload.hash) {
                self.lru.remove(slot);
                self.lru.push_back(slot);
                held_in_batch += 1;
            } else {
                fresh.push(offload);
            }
        }
        fresh.truncate(self.slots.len() - held_in_batch);
        let evict = fresh.len().saturating_sub(self.free.len());
        for _ in 0..evict {
            // Held blocks of this batch are at the back: the front ones go first.
            let Some(slot) = self.lru.pop_front() else {
                break;
            };
            let (hash, engine_hash) = self.slots[slot as usize];
            self.index.remove(&hash);
            self.free.push(slot);
            self.events.removed(engine_hash, Medium::Cpu);
        }
        for offload in fresh {
            let Some(slot) = self.free.pop() else { break };
            self.slots[slot as usize] = (offload.hash, offload.engine_hash);
            self.index.insert(offload.hash, slot);
            self.lru.push_back(slot);
            self.events.offloaded(offload.event);
        }
    }

    /// Drops every block and every queued offload, announcing nothing.
    pub(super) fn clear(&mut self) {
        self.pending.clear();
        for (_, slot) in self.index.drain() {
            self.lru.remove(slot);
            self.free.push(slot);
        }
    }

    /// The events recorded since the last call.
    pub(super) fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.take()
    }
}

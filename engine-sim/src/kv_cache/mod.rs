//! The KV block pool with vLLM-style automatic prefix caching.
//!
//! - *Active* blocks are referenced by running sequences and ref-counted (a shared prefix is
//!   held once).
//! - *Inactive* blocks have no reference but keep their hash: they stay matchable until evicted,
//!   least recently released first ([`lru::LruList`]).
//! - Only full blocks carry a hash (the prefix-chained sequence hash); a partial block is freed
//!   outright when released.
//! - Releasing a sequence walks its blocks tail first, so its deeper blocks become older than its
//!   prefix and are evicted first.
//!
//! - With a host tier ([`KvCache::with_host_tier`], vLLM's OffloadingConnector) every block
//!   stored on the device is offloaded there too ([`host`]); a prompt's blocks after its device
//!   hit that the tier holds are loaded instead of prefilled.
//!
//! Every store, eviction and reset is recorded for the KV event stream: the device's events
//! first, then the host tier's, as vLLM's scheduler appends the connector's events to the KV
//! cache manager's.

mod host;
mod lru;

use std::collections::HashMap;
use std::sync::Arc;

use host::HostTier;
use lru::LruList;

use crate::config::OffloadEvents;
use crate::hashing::EngineHash;
use crate::kv_events::{EventBuffer, KvEvent, Medium};
use crate::lora::Lora;

/// Index of a block in the pool.
pub(crate) type BlockId = u32;

#[derive(Debug, Clone, Copy, Default)]
struct Block {
    refs: u32,
    /// Sequence hash while the block is a cached full block.
    hash: Option<u64>,
    /// Engine hash published for the block while it is cached.
    engine_hash: EngineHash,
}

/// The engine's KV cache.
#[derive(Debug)]
pub(crate) struct KvCache {
    block_size: usize,
    prefix_caching: bool,
    blocks: Vec<Block>,
    free: Vec<BlockId>,
    inactive: LruList,
    cached: HashMap<u64, BlockId>,
    active: usize,
    events: EventBuffer,
    epoch: u64,
    host: Option<HostTier>,
}

impl KvCache {
    /// A cache of `num_blocks` empty blocks of `block_size` tokens.
    pub(crate) fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        // Ids are u32; a pool that large would not fit in memory anyway.
        let num_blocks = num_blocks.min(u32::MAX as usize - 1);
        Self {
            block_size,
            prefix_caching,
            blocks: vec![Block::default(); num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            inactive: LruList::new(num_blocks),
            cached: HashMap::new(),
            active: 0,
            events: EventBuffer::default(),
            epoch: 0,
            host: None,
        }
    }

    /// The same cache with a host tier of `blocks` blocks (none when 0) whose stores are
    /// announced in `form`.
    pub(crate) fn with_host_tier(mut self, blocks: usize, form: OffloadEvents) -> Self {
        self.host = (blocks > 0).then(|| HostTier::new(blocks, form));
        self
    }

    /// Whether a host tier backs the cache.
    pub(crate) fn has_host_tier(&self) -> bool {
        self.host.is_some()
    }

    /// Blocks the host tier holds.
    #[cfg(test)]
    pub(crate) fn host_blocks(&self) -> usize {
        self.host.as_ref().map_or(0, HostTier::len)
    }

    /// Capacity in blocks.
    pub(crate) fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks referenced by running sequences.
    #[cfg(test)]
    pub(crate) fn active_blocks(&self) -> usize {
        self.active
    }

    /// Cached blocks nobody references (the evictable prefix cache).
    #[cfg(test)]
    pub(crate) fn inactive_blocks(&self) -> usize {
        self.inactive.len()
    }

    /// Active blocks / capacity (1.0 for an empty pool).
    pub(crate) fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            1.0
        } else {
            self.active as f64 / self.blocks.len() as f64
        }
    }

    /// Changes on every reset; sequences admitted before a reset must not store blocks after it.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Blocks that can be allocated now: free ones plus evictable ones.
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.inactive.len()
    }

    /// Number of leading `hashes` whose blocks are resident (active or inactive).
    pub(crate) fn lookup(&self, hashes: &[u64]) -> usize {
        if !self.prefix_caching {
            return 0;
        }
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Number of leading `hashes` the host tier holds (0 without one, or without prefix
    /// caching).
    pub(crate) fn host_lookup(&self, hashes: &[u64]) -> usize {
        match &self.host {
            Some(host) if self.prefix_caching => host.lookup(hashes),
            _ => 0,
        }
    }

    /// Marks the host tier's blocks among `hashes` as just used (they were loaded).
    pub(crate) fn host_touch(&mut self, hashes: &[u64]) {
        if let Some(host) = &mut self.host {
            host.touch(hashes);
        }
    }

    /// How many of `hashes` (all resident) sit in the inactive pool, i.e. would stop being
    /// evictable once acquired.
    pub(crate) fn inactive_among(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .filter_map(|h| self.cached.get(h))
            .filter(|&&id| self.blocks[id as usize].refs == 0)
            .count()
    }

    /// Takes a reference on the resident blocks of `hashes` (all must be resident, see
    /// [`Self::lookup`]); returns their ids and engine hashes in order.
    pub(crate) fn acquire(&mut self, hashes: &[u64]) -> Vec<(BlockId, EngineHash)> {
        let mut out = Vec::with_capacity(hashes.len());
        for h in hashes {
            let Some(&id) = self.cached.get(h) else { break };
            let block = &mut self.blocks[id as usize];
            if block.refs == 0 {
                self.inactive.remove(id);
                self.active += 1;
            }
            block.refs += 1;
            out.push((id, block.engine_hash));
        }
        out
    }

    /// A fresh block with one reference: a free one, else the least recently used inactive one
    /// (evicted, which records a removal). `None` when everything is active.
    pub(crate) fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = self.inactive.pop_front()?;
                let block = &mut self.blocks[id as usize];
                if let Some(hash) = block.hash.take() {
                    self.cached.remove(&hash);
                    self.events.removed(block.engine_hash, Medium::Gpu);
                }
                id
            }
        };
        self.blocks[id as usize].refs = 1;
        self.active += 1;
        Some(id)
    }

    /// Drops one reference on each of a sequence's blocks, last block first.
    pub(crate) fn release(&mut self, blocks: &[BlockId]) {
        for &id in blocks.iter().rev() {
            let block = &mut self.blocks[id as usize];
            debug_assert!(block.refs > 0);
            block.refs = block.refs.saturating_sub(1);
            if block.refs > 0 {
                continue;
            }
            self.active -= 1;
            if block.hash.is_some() {
                self.inactive.push_back(id);
            } else {
                self.free.push(id);
            }
        }
    }

    /// Makes a just-filled block a cached block under `hash`, recording a store event with its
    /// `engine_hash`, `parent` engine hash, adapter `lora` and request `cache_salt`, and queues
    /// it for the host tier ([`Self::offload_stored`]). Returns false when caching is off or
    /// another block already holds `hash` (the block then stays uncached, as in vLLM).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn promote(
        &mut self,
        id: BlockId,
        hash: u64,
        engine_hash: EngineHash,
        parent: Option<EngineHash>,
        tokens: &[u32],
        lora: Option<&Lora>,
        cache_salt: Option<&Arc<str>>,
    ) -> bool {
        if !self.prefix_caching || self.cached.contains_key(&hash) {
            return false;
        }
        let block = &mut self.blocks[id as usize];
        debug_assert!(block.hash.is_none() && block.refs > 0);
        block.hash = Some(hash);
        block.engine_hash = engine_hash;
        self.cached.insert(hash, id);
        self.events.stored(
            engine_hash,
            parent,
            tokens,
            self.block_size,
            lora,
            cache_salt,
        );
        if let Some(host) = &mut self.host {
            host.queue(hash, engine_hash, parent, tokens, self.block_size, lora);
        }
        true
    }

    /// Offloads the blocks stored since the last call to the host tier (once per iteration,
    /// after its stores).
    pub(crate) fn offload_stored(&mut self) {
        if let Some(host) = &mut self.host {
            host.offload_queued();
        }
    }

    /// Forgets every cached hash: inactive blocks become free, active ones stay in use
    /// uncached; the host tier is emptied without an event of its own.
    pub(crate) fn reset(&mut self) {
        for (_, id) in self.cached.drain() {
            let block = &mut self.blocks[id as usize];
            block.hash = None;
            if self.inactive.remove(id) {
                self.free.push(id);
            }
        }
        if let Some(host) = &mut self.host {
            host.clear();
        }
        self.epoch += 1;
        self.events.cleared();
    }

    /// The events recorded since the last call: the device's, then the host tier's.
    pub(crate) fn take_events(&mut self) -> Vec<KvEvent> {
        let mut events = self.events.take();
        if let Some(host) = &mut self.host {
            events.extend(host.take_events());
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine hash the tests give sequence hash `h`: id `h + 1000`.
    fn eh(h: u64) -> EngineHash {
        let mut digest = [0u8; 32];
        digest[24..].copy_from_slice(&(h + 1000).to_be_bytes());
        EngineHash::from_digest(digest)
    }

    /// Allocates `n` blocks and promotes them under `hashes`, as a finished prefill would.
    fn store(cache: &mut KvCache, hashes: &[u64]) -> Vec<BlockId> {
        let mut ids = Vec::new();
        let mut parent = None;
        for &h in hashes {
            let id = cache.allocate().expect("free block");
            assert!(cache.promote(id, h, eh(h), parent, &[0, 0], None, None));
            parent = Some(eh(h));
            ids.push(id);
        }
        ids
    }

    #[test]
    fn admission_reuses_resident_prefix() {
        let mut c = KvCache::new(8, 2, true);
        let ids = store(&mut c, &[1, 2, 3]);
        assert_eq!(c.active_blocks(), 3);
        assert_eq!(c.lookup(&[1, 2, 9]), 2);
        let got = c.acquire(&[1, 2]);
        assert_eq!(got, vec![(ids[0], eh(1)), (ids[1], eh(2))]);
        c.release(&ids);
        // Blocks 1 and 2 are still held by the second sequence; 3 went inactive.
        assert_eq!(c.active_blocks(), 2);
        assert_eq!(c.inactive_blocks(), 1);
        assert_eq!(c.lookup(&[1, 2, 3]), 3);
        assert_eq!(c.inactive_among(&[1, 2, 3]), 1);
    }

    #[test]
    fn eviction_is_lru_and_tail_first() {
        let mut c = KvCache::new(4, 2, true);
        let a = store(&mut c, &[10, 11]);
        let b = store(&mut c, &[20, 21]);
        c.release(&a);
        c.release(&b);
        c.take_events();
        // Order of release: 11, 10, 21, 20. Evict two blocks.
        assert!(c.allocate().is_some());
        assert!(c.allocate().is_some());
        assert_eq!(
            c.take_events(),
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![eh(11), eh(10)],
                medium: Medium::Gpu,
            }]
        );
        assert_eq!(c.lookup(&[10]), 0);
        assert_eq!(c.lookup(&[20, 21]), 2);
    }

    #[test]
    fn reuse_refreshes_lru_position() {
        let mut c = KvCache::new(3, 2, true);
        let a = store(&mut c, &[1]);
        let b = store(&mut c, &[2]);
        c.release(&a);
        c.release(&b);
        // Touch 1 again: 2 becomes the oldest.
        let again = c.acquire(&[1]);
        c.release(&[again[0].0]);
        assert!(c.allocate().is_some()); // the free block
        assert!(c.allocate().is_some()); // evicts 2
        assert_eq!(c.lookup(&[1]), 1);
        assert_eq!(c.lookup(&[2]), 0);
    }

    #[test]
    fn partial_blocks_are_freed_not_cached() {
        let mut c = KvCache::new(2, 2, true);
        let id = c.allocate().expect("block");
        c.release(&[id]);
        assert_eq!(c.inactive_blocks(), 0);
        assert_eq!(c.available(), 2);
        assert!(c.take_events().is_empty());
    }

    #[test]
    fn allocation_fails_when_everything_is_active() {
        let mut c = KvCache::new(2, 2, true);
        assert!(c.allocate().is_some());
        assert!(c.allocate().is_some());
        assert!(c.allocate().is_none());
        assert_eq!(c.usage(), 1.0);
    }

    #[test]
    fn duplicate_hash_stays_uncached() {
        let mut c = KvCache::new(4, 2, true);
        store(&mut c, &[5]);
        let id = c.allocate().expect("block");
        assert!(!c.promote(id, 5, eh(5), None, &[0, 0], None, None));
        c.release(&[id]);
        assert_eq!(c.inactive_blocks(), 0);
    }

    #[test]
    fn without_prefix_caching_nothing_matches() {
        let mut c = KvCache::new(4, 2, false);
        let id = c.allocate().expect("block");
        assert!(!c.promote(id, 5, eh(5), None, &[0, 0], None, None));
        assert_eq!(c.lookup(&[5]), 0);
        assert!(c.take_events().is_empty());
    }

    #[test]
    fn reset_clears_everything_cached() {
        let mut c = KvCache::new(4, 2, true);
        let a = store(&mut c, &[1, 2]);
        c.release(&a[1..]);
        c.reset();
        assert_eq!(c.lookup(&[1]), 0);
        assert_eq!(c.inactive_blocks(), 0);
        assert_eq!(c.available(), 3);
        assert_eq!(c.epoch(), 1);
        assert_eq!(c.take_events().last(), Some(&KvEvent::AllBlocksCleared));
        // The still-active block is freed outright later, without a removal event.
        c.release(&a[..1]);
        assert_eq!(c.available(), 4);
        assert!(c.take_events().is_empty());
    }

    /// The host tier's events among `events`.
    fn host_events(events: &[KvEvent]) -> Vec<&KvEvent> {
        events
            .iter()
            .filter(|e| {
                matches!(
                    e,
                    KvEvent::BlockStored {
                        medium: Medium::Cpu,
                        ..
                    } | KvEvent::BlockRemoved {
                        medium: Medium::Cpu,
                        ..
                    }
                )
            })
            .collect()
    }

    fn placeholder(h: u64) -> KvEvent {
        KvEvent::host_placeholder(eh(h))
    }

    #[test]
    fn stored_blocks_are_offloaded_after_the_device_stores() {
        let mut c = KvCache::new(8, 2, true).with_host_tier(4, OffloadEvents::Placeholder);
        assert!(c.has_host_tier());
        store(&mut c, &[1, 2]);
        // Nothing reaches the tier before the iteration ends.
        assert_eq!(c.host_lookup(&[1]), 0);
        c.offload_stored();
        assert_eq!(c.host_blocks(), 2);
        assert_eq!(c.host_lookup(&[1, 2, 3]), 2);
        let events = c.take_events();
        assert_eq!(events.len(), 3, "{events:?}");
        assert!(matches!(
            &events[0],
            KvEvent::BlockStored { block_hashes, medium: Medium::Gpu, .. }
                if *block_hashes == [eh(1), eh(2)]
        ));
        assert_eq!(events[1..], [placeholder(1), placeholder(2)]);
    }

    #[test]
    fn self_describing_stores_carry_parent_tokens_size_and_adapter() {
        let mut c = KvCache::new(8, 2, true).with_host_tier(4, OffloadEvents::SelfDescribing);
        let lora = Lora {
            id: 3,
            name: "sql".into(),
        };
        let salt: Arc<str> = Arc::from("tenant-a");
        let a = c.allocate().expect("block");
        assert!(c.promote(a, 1, eh(1), None, &[5, 6], Some(&lora), Some(&salt)));
        let b = c.allocate().expect("block");
        assert!(c.promote(b, 2, eh(2), Some(eh(1)), &[7, 8], Some(&lora), None));
        c.offload_stored();
        let events = c.take_events();
        let host = host_events(&events);
        let expected =
            |h: u64, parent: Option<EngineHash>, tokens: Vec<u32>| KvEvent::BlockStored {
                block_hashes: vec![eh(h)],
                parent_block_hash: parent,
                token_ids: tokens,
                block_size: 2,
                lora: Some(lora.clone()),
                // Offload events have no extra_keys: the salt is only in the device event.
                cache_salt: None,
                medium: Medium::Cpu,
            };
        assert_eq!(
            host,
            [
                &expected(1, None, vec![5, 6]),
                &expected(2, Some(eh(1)), vec![7, 8])
            ]
        );
    }

    #[test]
    fn a_full_tier_evicts_its_least_recently_used_blocks_in_one_removal() {
        let mut c = KvCache::new(16, 2, true).with_host_tier(3, OffloadEvents::Placeholder);
        store(&mut c, &[1, 2, 3]);
        c.offload_stored();
        c.take_events();
        // Block 1 is used again (loaded): 2 and 3 are now the oldest.
        c.host_touch(&[1]);
        store(&mut c, &[4, 5]);
        c.offload_stored();
        let events = c.take_events();
        assert_eq!(
            host_events(&events),
            [
                &KvEvent::BlockRemoved {
                    block_hashes: vec![eh(2), eh(3)],
                    medium: Medium::Cpu,
                },
                &placeholder(4),
                &placeholder(5),
            ]
        );
        assert_eq!(c.host_blocks(), 3);
        assert_eq!(c.host_lookup(&[1]), 1);
        assert_eq!(c.host_lookup(&[2]), 0);
        assert_eq!(c.host_lookup(&[4, 5]), 2);
    }

    #[test]
    fn a_block_already_offloaded_is_refreshed_without_an_event() {
        let mut c = KvCache::new(4, 2, true).with_host_tier(2, OffloadEvents::Placeholder);
        let a = store(&mut c, &[1]);
        let b = store(&mut c, &[2]);
        c.offload_stored();
        c.release(&a);
        c.release(&b);
        // The device evicts both; the tier keeps them (1 the older).
        let filler: Vec<BlockId> = (0..4).map(|_| c.allocate().expect("block")).collect();
        c.release(&filler);
        assert_eq!(c.lookup(&[1]), 0);
        assert_eq!(c.host_lookup(&[1, 2]), 2);
        c.take_events();
        // 1 is stored on the device again: the tier announces nothing, 1 becomes the newest.
        store(&mut c, &[1]);
        c.offload_stored();
        let events = c.take_events();
        assert_eq!(events.len(), 1, "{events:?}");
        assert!(host_events(&events).is_empty());
        store(&mut c, &[3]);
        c.offload_stored();
        assert_eq!(
            host_events(&c.take_events()),
            [
                &KvEvent::BlockRemoved {
                    block_hashes: vec![eh(2)],
                    medium: Medium::Cpu,
                },
                &placeholder(3),
            ]
        );
    }

    #[test]
    fn reset_empties_the_tier_and_announces_only_the_device_clear() {
        let mut c = KvCache::new(8, 2, true).with_host_tier(4, OffloadEvents::Placeholder);
        store(&mut c, &[1, 2]);
        c.offload_stored();
        c.take_events();
        // A block stored but not offloaded yet is dropped too.
        store(&mut c, &[3]);
        c.reset();
        c.offload_stored();
        assert_eq!(c.host_blocks(), 0);
        assert_eq!(c.host_lookup(&[1, 2]), 0);
        let events = c.take_events();
        assert_eq!(events.last(), Some(&KvEvent::AllBlocksCleared));
        assert!(host_events(&events).is_empty(), "{events:?}");
    }

    #[test]
    fn without_a_tier_nothing_is_offloaded() {
        let mut c = KvCache::new(4, 2, true).with_host_tier(0, OffloadEvents::Placeholder);
        assert!(!c.has_host_tier());
        store(&mut c, &[1]);
        c.offload_stored();
        assert_eq!(c.host_lookup(&[1]), 0);
        assert!(host_events(&c.take_events()).is_empty());
    }
}

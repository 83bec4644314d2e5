//! KV cache events in vLLM's model (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).
//!
//! The scheduler publishes one [`KvEventBatch`] per iteration that changed the cache; subscribe
//! with [`crate::EngineHandle::subscribe_kv_events`], or over ZMQ in vLLM's wire format
//! (see `crate::zmq_events`). Hashes are engine hashes ([`EngineHash`]), not kvmesh's sequence
//! hashes.

use std::sync::Arc;

use crate::hashing::EngineHash;
use crate::lora::Lora;

/// Where a cached block lives: vLLM's `medium` strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// The device's KV cache (`"GPU"`).
    Gpu,
    /// The host-memory tier of the offloading connector (`"CPU"`).
    Cpu,
}

impl Medium {
    /// vLLM's string: `GPU` or `CPU`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpu => "GPU",
            Self::Cpu => "CPU",
        }
    }
}

/// One change to the set of cached blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive full blocks of one sequence became cached (matchable) blocks on `medium`.
    /// A host-tier store covers one block; in the placeholder form (vLLM's default) it has
    /// only the hash: no parent, no tokens, `block_size` 0, no adapter.
    BlockStored {
        /// Engine hash of each stored block, in order.
        block_hashes: Vec<EngineHash>,
        /// Engine hash of the block before the first one; `None` at sequence start.
        parent_block_hash: Option<EngineHash>,
        /// All blocks' tokens concatenated (`block_hashes.len() * block_size` ids).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// The LoRA adapter the blocks were computed with; `None` for the base model.
        lora: Option<Lora>,
        /// The `cache_salt` of the request that stored the first block, only when that block
        /// starts a sequence (no parent): vLLM lists it in that block's `extra_keys`. Never on
        /// the host tier (vLLM's offload events have no `extra_keys`).
        cache_salt: Option<Arc<str>>,
        /// Where the blocks are now.
        medium: Medium,
    },
    /// Cached blocks were evicted from `medium`.
    BlockRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<EngineHash>,
        /// Where they were.
        medium: Medium,
    },
    /// Every cached block was dropped (prefix-cache reset; the host tier is emptied too,
    /// without an event of its own, as vLLM's `reset_prefix_cache?reset_external=true`).
    AllBlocksCleared,
}

impl KvEvent {
    /// A host-tier store of one block in vLLM's placeholder form: its hash alone.
    pub fn host_placeholder(hash: EngineHash) -> Self {
        Self::BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 0,
            lora: None,
            cache_salt: None,
            medium: Medium::Cpu,
        }
    }
}

/// The events of one scheduler iteration, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Seconds since the Unix epoch when the batch was published.
    pub timestamp: f64,
    /// The events.
    pub events: Vec<KvEvent>,
    /// Test-only fault injection: the engine simulated a restart right before this batch (whose
    /// events are a single `AllBlocksCleared`); event sequence numbers start over.
    pub engine_restarted: bool,
}

/// Collects events during an iteration, merging adjacent device stores of one chain and
/// adjacent removals from one medium.
#[derive(Debug, Default)]
pub(crate) struct EventBuffer {
    events: Vec<KvEvent>,
}

impl EventBuffer {
    /// Records that one block, computed with adapter `lora` (`None`: the base model) for a
    /// request with `cache_salt`, was stored on the device.
    pub(crate) fn stored(
        &mut self,
        hash: EngineHash,
        parent: Option<EngineHash>,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&Lora>,
        cache_salt: Option<&Arc<str>>,
    ) {
        if let Some(KvEvent::BlockStored {
            block_hashes,
            token_ids,
            medium: Medium::Gpu,
            ..
        }) = self.events.last_mut()
            && parent.is_some()
            && block_hashes.last() == parent.as_ref()
        {
            block_hashes.push(hash);
            token_ids.extend_from_slice(tokens);
            return;
        }
        self.events.push(KvEvent::BlockStored {
            block_hashes: vec![hash],
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size,
            lora: lora.cloned(),
            cache_salt: cache_salt.filter(|_| parent.is_none()).cloned(),
            medium: Medium::Gpu,
        });
    }

    /// Records a host-tier store: one event per block, never merged (vLLM's offloading
    /// connector announces each chunk on its own).
    pub(crate) fn offloaded(&mut self, event: KvEvent) {
        debug_assert!(matches!(
            event,
            KvEvent::BlockStored {
                medium: Medium::Cpu,
                ..
            }
        ));
        self.events.push(event);
    }

    /// Records that one block was evicted from `medium`.
    pub(crate) fn removed(&mut self, hash: EngineHash, medium: Medium) {
        if let Some(KvEvent::BlockRemoved {
            block_hashes,
            medium: last,
        }) = self.events.last_mut()
            && *last == medium
        {
            block_hashes.push(hash);
            return;
        }
        self.events.push(KvEvent::BlockRemoved {
            block_hashes: vec![hash],
            medium,
        });
    }

    /// Records a full reset.
    pub(crate) fn cleared(&mut self) {
        self.events.push(KvEvent::AllBlocksCleared);
    }

    /// Takes the buffered events.
    pub(crate) fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: u8) -> EngineHash {
        EngineHash::from_digest([n; 32])
    }

    #[test]
    fn chained_stores_merge_and_removals_merge() {
        let mut b = EventBuffer::default();
        let lora = Lora {
            id: 1,
            name: "a".into(),
        };
        let salt: Arc<str> = Arc::from("tenant-a");
        b.stored(h(1), None, &[1, 2], 2, None, Some(&salt));
        b.stored(h(2), Some(h(1)), &[3, 4], 2, None, Some(&salt));
        b.stored(h(9), Some(h(5)), &[7, 8], 2, Some(&lora), Some(&salt));
        b.removed(h(3), Medium::Gpu);
        b.removed(h(4), Medium::Gpu);
        let events = b.take();
        assert_eq!(
            events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![h(1), h(2)],
                    parent_block_hash: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora: None,
                    cache_salt: Some(salt.clone()),
                    medium: Medium::Gpu,
                },
                KvEvent::BlockStored {
                    block_hashes: vec![h(9)],
                    parent_block_hash: Some(h(5)),
                    token_ids: vec![7, 8],
                    block_size: 2,
                    lora: Some(lora),
                    // Not the first block of its sequence: the salt is in its parent's hash.
                    cache_salt: None,
                    medium: Medium::Gpu,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![h(3), h(4)],
                    medium: Medium::Gpu,
                },
            ]
        );
        assert!(b.take().is_empty());
    }

    #[test]
    fn host_stores_stay_apart_and_removals_merge_per_medium() {
        let mut b = EventBuffer::default();
        let host = KvEvent::host_placeholder;
        b.offloaded(host(h(1)));
        // A device store whose parent is the host store's hash does not join it.
        b.stored(h(2), Some(h(1)), &[3, 4], 2, None, None);
        b.offloaded(host(h(2)));
        b.offloaded(host(h(3)));
        b.removed(h(5), Medium::Gpu);
        b.removed(h(6), Medium::Cpu);
        b.removed(h(7), Medium::Cpu);
        let events = b.take();
        assert_eq!(events.len(), 6, "{events:?}");
        assert_eq!(events[0], host(h(1)));
        assert!(matches!(
            &events[1],
            KvEvent::BlockStored { block_hashes, medium: Medium::Gpu, .. } if *block_hashes == [h(2)]
        ));
        assert_eq!(events[2..4], [host(h(2)), host(h(3))]);
        assert_eq!(
            events[4..],
            [
                KvEvent::BlockRemoved {
                    block_hashes: vec![h(5)],
                    medium: Medium::Gpu
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![h(6), h(7)],
                    medium: Medium::Cpu
                },
            ]
        );
    }
}

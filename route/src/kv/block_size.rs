//! A `policy: kv` model's block size, and the instances whose engines run another.
//!
//! The proxy cuts prompts into blocks of the model's block size and hashes them; an engine's
//! KV events (re-hashed by its agent) only match when its blocks are the same size. The size
//! is `kv.block_size` when the config sets it; unset, the first instance record of the model
//! sets it (the engine's own size, which its agent registers), and until one has (static
//! backends only) it is [`FALLBACK_BLOCK_SIZE`], vLLM's GPU default. Once no registered
//! instance is left, the next record sets it again.
//!
//! An instance whose engine runs another size is a *conflict*: its KV events are not indexed
//! (they could never match), so it is scored by the proxy's predictions alone, as in
//! approximate mode, and the conflict is reported (`/health`, a gauge, `x-kvmesh-route`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use kvmesh_config::FALLBACK_BLOCK_SIZE;

/// How an instance's engine block size fits its model's ([`crate::kv::KvRouter::fit_block_size`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockSizeFit {
    /// The model had no block size yet (`kv.block_size` unset, no registered instance): it
    /// takes the engine's.
    Adopted,
    /// The engine's is the model's (or the record does not say).
    Matches,
    /// The engine runs blocks of another size than `model`: the instance is scored by
    /// predictions alone.
    Differs {
        /// The model's block size.
        model: u64,
    },
}

/// The block size of one model, shared with its preparer (which hashes by it).
#[derive(Debug)]
pub(crate) struct ModelBlockSize {
    /// `kv.block_size`, when set.
    configured: Option<u64>,
    /// Set by the first instance record while `configured` is `None` (0: none yet).
    discovered: AtomicU64,
    /// The size in force, read on every request (the preparer holds it too).
    current: Arc<AtomicU64>,
    /// Instances whose engine runs another block size, with that size.
    conflicts: ArcSwap<HashMap<u64, u64>>,
}

impl ModelBlockSize {
    /// `configured` (`kv.block_size`), or unset until an instance record says.
    pub(crate) fn new(configured: Option<usize>) -> Self {
        let configured = configured.filter(|&size| size > 0).map(|size| size as u64);
        Self {
            configured,
            discovered: AtomicU64::new(0),
            current: Arc::new(AtomicU64::new(
                configured.unwrap_or(FALLBACK_BLOCK_SIZE as u64),
            )),
            conflicts: ArcSwap::from_pointee(HashMap::new()),
        }
    }

    /// The size in force, shared (for the preparer).
    pub(crate) fn shared(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.current)
    }

    /// Tokens per block now.
    #[inline]
    pub(crate) fn get(&self) -> u64 {
        self.current.load(Ordering::Relaxed)
    }

    /// Instance `instance`'s engine runs blocks of `engine` tokens (0: its record does not
    /// say). Adopts it while the model has none; records or clears the instance's conflict.
    /// Called by discovery alone (one writer).
    pub(crate) fn fit(&self, instance: u64, engine: u64) -> BlockSizeFit {
        let fit = if engine == 0 {
            BlockSizeFit::Matches
        } else if self.configured.is_none()
            && self
                .discovered
                .compare_exchange(0, engine, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.current.store(engine, Ordering::Relaxed);
            BlockSizeFit::Adopted
        } else if engine == self.get() {
            BlockSizeFit::Matches
        } else {
            BlockSizeFit::Differs { model: self.get() }
        };
        match fit {
            BlockSizeFit::Differs { .. } => self.set_conflict(instance, Some(engine)),
            BlockSizeFit::Adopted | BlockSizeFit::Matches => self.set_conflict(instance, None),
        }
        fit
    }

    /// Instance `instance` left: it is no conflict any more.
    pub(crate) fn forget(&self, instance: u64) {
        self.set_conflict(instance, None);
    }

    /// No registered instance is left: unless `kv.block_size` is set, the next record sets
    /// the size again (meanwhile [`FALLBACK_BLOCK_SIZE`]). Returns whether it was unset.
    pub(crate) fn reset(&self) -> bool {
        if self.configured.is_some() || self.discovered.swap(0, Ordering::AcqRel) == 0 {
            return false;
        }
        self.current
            .store(FALLBACK_BLOCK_SIZE as u64, Ordering::Relaxed);
        self.conflicts.store(Arc::new(HashMap::new()));
        true
    }

    /// The block size of instance `instance`'s engine when it differs from the model's.
    #[inline]
    pub(crate) fn conflict(&self, instance: u64) -> Option<u64> {
        let conflicts = self.conflicts.load();
        if conflicts.is_empty() {
            return None;
        }
        conflicts.get(&instance).copied()
    }

    /// Every instance in conflict with its engine's block size, by id.
    pub(crate) fn conflicts(&self) -> Vec<(u64, u64)> {
        let mut all: Vec<(u64, u64)> = self
            .conflicts
            .load()
            .iter()
            .map(|(&id, &size)| (id, size))
            .collect();
        all.sort_unstable();
        all
    }

    fn set_conflict(&self, instance: u64, engine: Option<u64>) {
        let current = self.conflicts.load();
        if current.get(&instance).copied() == engine {
            return;
        }
        let mut next = HashMap::clone(&current);
        match engine {
            Some(size) => next.insert(instance, size),
            None => next.remove(&instance),
        };
        self.conflicts.store(Arc::new(next));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_the_first_record_sets_it_and_another_size_conflicts() {
        let size = ModelBlockSize::new(None);
        let shared = size.shared();
        assert_eq!(size.get(), 16, "static backends only: vLLM's GPU default");
        assert_eq!(
            size.fit(1, 0),
            BlockSizeFit::Matches,
            "a record without one"
        );
        assert_eq!(size.get(), 16);
        assert_eq!(size.fit(1, 32), BlockSizeFit::Adopted);
        assert_eq!((size.get(), shared.load(Ordering::Relaxed)), (32, 32));
        assert_eq!(size.fit(2, 32), BlockSizeFit::Matches);
        assert_eq!(size.fit(3, 16), BlockSizeFit::Differs { model: 32 });
        assert_eq!(size.conflict(3), Some(16));
        assert_eq!(size.conflict(2), None);
        assert_eq!(size.conflicts(), [(3, 16)]);
        // The instance re-registered with the model's size: no conflict any more.
        assert_eq!(size.fit(3, 32), BlockSizeFit::Matches);
        assert!(size.conflicts().is_empty());
        assert_eq!(size.fit(4, 64), BlockSizeFit::Differs { model: 32 });
        size.forget(4);
        assert!(size.conflicts().is_empty());
        // Every registered instance left: the next record sets it again.
        assert_eq!(size.fit(5, 64), BlockSizeFit::Differs { model: 32 });
        assert!(size.reset());
        assert!(size.conflicts().is_empty());
        assert_eq!(shared.load(Ordering::Relaxed), 16);
        assert!(!size.reset());
        assert_eq!(size.fit(6, 64), BlockSizeFit::Adopted);
        assert_eq!(shared.load(Ordering::Relaxed), 64);
    }

    #[test]
    fn a_configured_size_stays_and_differing_engines_conflict() {
        let size = ModelBlockSize::new(Some(64));
        assert_eq!(size.get(), 64);
        assert_eq!(size.fit(1, 16), BlockSizeFit::Differs { model: 64 });
        assert_eq!(size.fit(2, 64), BlockSizeFit::Matches);
        assert!(!size.reset());
        assert_eq!(size.get(), 64);
        assert_eq!(size.conflicts(), [(1, 16)]);
    }
}

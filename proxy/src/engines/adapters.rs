//! A pool's LoRA adapters: which of its instances serve each adapter (static `adapters:` of a
//! backend, or the `adapters` of an agent's record). A request naming an adapter picks only
//! from that adapter's instances; the lists are rebuilt on every change, so the request path
//! reads them without a lock.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;

use crate::engines::instance::Instance;

/// Instances serving one adapter, in the pool's order.
type Serving = Arc<Vec<Arc<Instance>>>;

/// The adapters of one pool's instances.
#[derive(Debug, Default)]
pub(crate) struct Adapters {
    /// Instance id → the adapters it serves (written by discovery only).
    served: Mutex<HashMap<u64, Vec<String>>>,
    /// Adapter → the instances serving it, for the request path.
    by_name: ArcSwap<BTreeMap<String, Serving>>,
}

impl Adapters {
    /// Instance `id` serves `adapters` (replacing what it served); `instances` is the pool's
    /// current list.
    pub(crate) fn set(&self, id: u64, adapters: Vec<String>, instances: &[Arc<Instance>]) {
        let mut served = self.served.lock().unwrap_or_else(PoisonError::into_inner);
        if adapters.is_empty() {
            served.remove(&id);
        } else {
            served.insert(id, adapters);
        }
        self.rebuild(&mut served, instances);
    }

    /// Takes what `previous` records for instances this table does not know (a pool rebuilt
    /// by a reload keeps the adapters of the instances it takes over); `instances` is the
    /// pool's current list.
    pub(crate) fn adopt(&self, previous: &Adapters, instances: &[Arc<Instance>]) {
        let theirs = previous
            .served
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut served = self.served.lock().unwrap_or_else(PoisonError::into_inner);
        for (id, adapters) in theirs {
            served.entry(id).or_insert(adapters);
        }
        self.rebuild(&mut served, instances);
    }

    /// The pool's instances changed to `instances`: instances gone no longer serve anything.
    pub(crate) fn instances_changed(&self, instances: &[Arc<Instance>]) {
        let mut served = self.served.lock().unwrap_or_else(PoisonError::into_inner);
        self.rebuild(&mut served, instances);
    }

    fn rebuild(&self, served: &mut HashMap<u64, Vec<String>>, instances: &[Arc<Instance>]) {
        served.retain(|id, _| instances.iter().any(|i| i.id() == *id));
        if served.is_empty() && self.by_name.load().is_empty() {
            return;
        }
        let mut by_name: BTreeMap<String, Vec<Arc<Instance>>> = BTreeMap::new();
        for instance in instances {
            for adapter in served.get(&instance.id()).into_iter().flatten() {
                by_name
                    .entry(adapter.clone())
                    .or_default()
                    .push(Arc::clone(instance));
            }
        }
        let by_name = by_name
            .into_iter()
            .map(|(name, list)| (name, Arc::new(list)))
            .collect();
        self.by_name.store(Arc::new(by_name));
    }

    /// The instances serving `adapter` (`None`: none does).
    pub(crate) fn serving(&self, adapter: &str) -> Option<Serving> {
        self.by_name.load().get(adapter).cloned()
    }

    /// Whether some instance serves `adapter`.
    pub(crate) fn contains(&self, adapter: &str) -> bool {
        self.by_name.load().contains_key(adapter)
    }

    /// Every adapter some instance serves, sorted.
    pub(crate) fn names(&self) -> Vec<String> {
        self.by_name.load().keys().cloned().collect()
    }
}

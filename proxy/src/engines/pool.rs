//! A model's pool: its instances, how it balances them and its metric handles.
//!
//! The instance set can change at run time (discovery): it is an immutable list behind an
//! [`ArcSwap`], replaced whole on every change. A request loads the current list once and
//! keeps it for all its attempts, so it never takes a lock and a removed instance stays
//! alive until its in-flight requests finish.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;
use kvmesh_config::{DisaggregationConfig, PoolConfig};
use kvmesh_route::Balancer;

use crate::edge::retry::RetryBudget;
use crate::engines::adapters::Adapters;
use crate::engines::clock::now_millis;
use crate::engines::instance::{Instance, Membership};
use crate::metrics::families::ModelMetrics;

/// The instances of a pool at one moment.
pub(crate) type Instances = Arc<Vec<Arc<Instance>>>;

/// Everything the request path needs for one model.
#[derive(Debug)]
pub(crate) struct ModelPool {
    name: String,
    instances: ArcSwap<Vec<Arc<Instance>>>,
    balancer: Balancer,
    /// Which instances serve which LoRA adapters.
    adapters: Adapters,
    metrics: ModelMetrics,
    /// Its requests and retries of the last budget window.
    retry_budget: RetryBudget,
    /// Migrations per stream.
    migration_limit: u32,
    /// Prefill and decode on separate instances.
    disaggregation: Option<DisaggregationConfig>,
    /// Its instances' pools, in order (empty: one pool of all).
    pools: Vec<PoolConfig>,
    /// Set when the pool left the registry: its background tasks stop.
    retired: AtomicBool,
}

impl ModelPool {
    /// A pool over `instances` whose streams may migrate `migration_limit` times, and whose
    /// requests are split into prefill and decode legs when `disaggregation` says.
    pub(crate) fn new(
        name: String,
        instances: Vec<Arc<Instance>>,
        balancer: Balancer,
        metrics: ModelMetrics,
        migration_limit: u32,
        disaggregation: Option<DisaggregationConfig>,
    ) -> Self {
        for instance in &instances {
            balancer.add_instance(instance.id());
        }
        Self {
            name,
            instances: ArcSwap::from_pointee(instances),
            balancer,
            adapters: Adapters::default(),
            metrics,
            retry_budget: RetryBudget::default(),
            migration_limit,
            disaggregation,
            pools: Vec::new(),
            retired: AtomicBool::new(false),
        }
    }

    /// How it balances.
    pub(crate) fn balancer(&self) -> &Balancer {
        &self.balancer
    }

    /// This pool with its instances grouped into `pools`.
    pub(crate) fn with_pools(mut self, pools: Vec<PoolConfig>) -> Self {
        self.pools = pools;
        self
    }

    /// Its instances' pools, in order (empty: one pool of all).
    pub(crate) fn pools(&self) -> &[PoolConfig] {
        &self.pools
    }

    /// How its requests split into prefill and decode legs (`None`: they do not).
    pub(crate) fn disaggregation(&self) -> Option<&DisaggregationConfig> {
        self.disaggregation.as_ref()
    }

    /// Canonical model name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The current instances (a snapshot: later changes do not affect it).
    pub(crate) fn instances(&self) -> Instances {
        self.instances.load_full()
    }

    /// The instances a request for `adapter` picks from (`None`: the base model, all of them);
    /// `None` when no instance serves the adapter.
    pub(crate) fn instances_for(&self, adapter: Option<&str>) -> Option<Instances> {
        match adapter {
            None => Some(self.instances()),
            Some(adapter) => self.adapters.serving(adapter),
        }
    }

    /// Whether some instance serves the LoRA adapter `name`.
    pub(crate) fn serves_adapter(&self, name: &str) -> bool {
        self.adapters.contains(name)
    }

    /// The LoRA adapters its instances serve, sorted.
    pub(crate) fn adapter_names(&self) -> Vec<String> {
        self.adapters.names()
    }

    /// Instance `id` serves the LoRA adapters `adapters` (replacing what it served).
    pub(crate) fn set_adapters(&self, id: u64, adapters: Vec<String>) {
        self.adapters.set(id, adapters, &self.instances.load());
    }

    /// The current instance with id `id`.
    pub(crate) fn instance(&self, id: u64) -> Option<Arc<Instance>> {
        self.instances.load().iter().find(|i| i.id() == id).cloned()
    }

    /// Takes over the instances of `previous` (the same ones, shared) that this pool does not
    /// have, with the adapters they serve: a pool rebuilt by a reload keeps every instance
    /// discovery gave the pool it replaces.
    pub(crate) fn adopt_instances(&self, previous: &ModelPool) {
        for instance in previous.instances().iter() {
            if self.instance(instance.id()).is_none() {
                self.add_instance(Arc::clone(instance));
            }
        }
        self.adapters
            .adopt(&previous.adapters, &self.instances.load());
    }

    /// Adds `instance` (replacing one with the same id, which is then removed).
    pub(crate) fn add_instance(&self, instance: Arc<Instance>) {
        let id = instance.id();
        let replaced = self.swap_instances(|current| {
            let mut next: Vec<Arc<Instance>> = current.to_vec();
            let old = next
                .iter()
                .position(|i| i.id() == id)
                .map(|at| next.remove(at));
            next.push(Arc::clone(&instance));
            (next, old)
        });
        if let Some(old) = replaced {
            old.leave();
        }
        self.adapters.instances_changed(&self.instances.load());
        self.balancer.add_instance(id);
    }

    /// Removes instance `id`: no new requests go to it, its streams that may migrate continue
    /// elsewhere, other in-flight requests finish, and its routing state (load, cached
    /// blocks) is dropped. Returns it when it was there.
    pub(crate) fn remove_instance(&self, id: u64) -> Option<Arc<Instance>> {
        let removed = self.swap_instances(|current| {
            let mut next: Vec<Arc<Instance>> = current.to_vec();
            let old = next
                .iter()
                .position(|i| i.id() == id)
                .map(|at| next.remove(at));
            (next, old)
        })?;
        removed.leave();
        self.adapters.instances_changed(&self.instances.load());
        self.balancer.remove_instance(id);
        Some(removed)
    }

    /// Replaces the instance list with what `change` makes of the current one (a single
    /// writer at a time: discovery).
    fn swap_instances<T>(
        &self,
        change: impl Fn(&[Arc<Instance>]) -> (Vec<Arc<Instance>>, Option<T>),
    ) -> Option<T> {
        let mut result = None;
        self.instances.rcu(|current| {
            let (next, out) = change(current);
            result = out;
            next
        });
        result
    }

    /// Marks the pool as gone from the registry.
    pub(crate) fn retire(&self) {
        self.retire_except(|_| false);
    }

    /// Marks the pool as gone from the registry; its instances for which `lives_on` holds
    /// keep serving in the pool that took them over (a reload), the others are removed.
    pub(crate) fn retire_except(&self, lives_on: impl Fn(&Arc<Instance>) -> bool) {
        self.retired.store(true, Ordering::Relaxed);
        for instance in self.instances.load().iter() {
            if !lives_on(instance) {
                instance.set_membership(Membership::Removed);
            }
        }
    }

    /// Whether the pool left the registry.
    pub(crate) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// How many times one stream may move to another instance.
    pub(crate) fn migration_limit(&self) -> u32 {
        self.migration_limit
    }

    /// Its retry budget's counts.
    pub(crate) fn retry_budget(&self) -> &RetryBudget {
        &self.retry_budget
    }

    /// Metric handles.
    pub(crate) fn metrics(&self) -> &ModelMetrics {
        &self.metrics
    }

    /// Copies live state into the pool's gauges (called before a scrape).
    pub(crate) fn refresh_gauges(&self) {
        let now = now_millis();
        let instances = self.instances();
        let disaggregated = self.disaggregation().is_some();
        for instance in instances.iter() {
            instance.refresh_gauges(now, disaggregated);
        }
        self.balancer.refresh_gauges(&instances);
    }

    /// Seconds a client should wait before retrying when nothing is available:
    /// until the first ejection ends, or one health-check interval.
    pub(crate) fn retry_after_secs(&self, health_interval_ms: u64) -> u64 {
        let now = now_millis();
        let wait_ms = self
            .instances
            .load()
            .iter()
            .filter(|i| i.is_healthy())
            .map(|i| i.ejection_remaining_ms(now))
            .filter(|&ms| ms > 0)
            .min()
            .unwrap_or(health_interval_ms);
        wait_ms.div_ceil(1_000).max(1)
    }
}

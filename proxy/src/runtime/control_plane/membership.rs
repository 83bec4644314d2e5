//! Applies a registry watch (etcd or in-process) to the model pools: instance records join,
//! change state and leave; models the config does not list appear with the
//! `discovery.default_model` settings while they have instances.
//!
//! - **Put** of a new record: an instance (id = the record's `instance_id`) joins its model's
//!   pool, routable only in state `ready`. A changed URL or protocol replaces the instance;
//!   a changed state only flips its routability (`not_ready` and `draining` take no new
//!   requests, in-flight ones finish); changed `adapters` change which LoRA adapters'
//!   requests it takes, a changed `total_blocks` the KV capacity its load is measured by.
//! - **Delete** (lease expired, agent deregistered): the instance leaves; in-flight
//!   requests finish on it, its load and cached blocks are dropped. A discovered model with no
//!   instance left leaves the registry (`GET /v1/models`), a configured one stays (503).
//! - **Disconnected**: nothing changes (the last known instances keep serving) until the watch
//!   re-lists and reports only the differences.
//!
//! Block sizes (`policy: kv`): a model whose `kv.block_size` is unset takes the block size of
//! its first instance record (a discovered model's pool is built with it), again once no
//! registered instance is left; an instance whose engine runs another size than its model
//! is scored by predictions alone and reported (a WARN, admin `/health` `degraded`,
//! `kvmesh_route_block_size_mismatch`). A record whose block size changed replaces its
//! instance. A joining instance's engine tokenizer is compared with the model's
//! ([`crate::state::tokenizer_check`]), in the background.

use std::collections::HashMap;
use std::sync::Arc;

use kvmesh_config::{
    BackendUrl, Config, DEFAULT_MIGRATION_LIMIT, DefaultModelConfig, HealthCheckConfig,
    KvRoutingConfig, Protocol, Role,
};
use kvmesh_control::{InstanceRecord, InstanceRole, InstanceState, Namespace, WatchEvent};
use kvmesh_route::kv::BlockSizeFit;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::engines::discovery::{InstanceSpec, ModelSpec};
use crate::engines::instance::Membership;
use crate::engines::pool::ModelPool;
use crate::engines::pool_builder::PoolBuilder;
use crate::runtime::control_plane::intake::IntakeInput;
use crate::runtime::control_plane::metrics::ControlMetrics;
use crate::state::health_check::spawn_probe;
use crate::state::kv_sweeper::spawn_sweeper;
use crate::state::shared::State;
use crate::state::tokenizer_check::spawn_check as spawn_tokenizer_check;

/// Where one registered instance lives.
#[derive(Debug, Clone)]
struct Registered {
    /// Canonical name of its model's pool.
    model: String,
    id: u64,
    url: String,
    protocol: Protocol,
    adapters: Vec<String>,
    /// The record it came from (a reload that gives its model a new pool re-applies it).
    record: InstanceRecord,
    /// When it joined, in join order (a new pool fits the block sizes in this order).
    joined: u64,
}

/// Where the reloader announces a [`Reloaded`] state.
pub(crate) type ReloadNotifier = tokio::sync::watch::Sender<Option<Reloaded>>;
/// Where the discovery loop hears of a [`Reloaded`] state.
pub(crate) type ReloadWatch = tokio::sync::watch::Receiver<Option<Reloaded>>;

/// A reload that gave models new pools while discovery runs: the discovery loop moves the
/// instances' events to the new pools ([`MembershipApplier::rehome`]).
#[derive(Debug, Clone)]
pub(crate) struct Reloaded {
    /// The state now in force.
    pub(crate) state: Arc<State>,
    /// The models its config lists.
    pub(crate) configured: Vec<String>,
}

/// Background work for instances and models that appear once the proxy runs.
#[derive(Debug)]
pub(crate) struct Spawner {
    /// Probes of new instances (`None`: health checks are off).
    pub(crate) health_check: Option<Arc<HealthCheckConfig>>,
    /// Where the tasks run; dropping it stops them.
    pub(crate) tasks: JoinSet<()>,
}

/// Keeps the pools in line with the registry's records.
#[derive(Debug)]
pub(crate) struct MembershipApplier {
    builder: Arc<PoolBuilder>,
    namespace: Namespace,
    default_model: DefaultModelConfig,
    /// Names of the models the config lists (they stay even without instances).
    configured: Vec<String>,
    by_key: HashMap<String, Registered>,
    /// The next [`Registered::joined`].
    joins: u64,
    intake: Option<mpsc::UnboundedSender<IntakeInput>>,
    metrics: ControlMetrics,
    spawner: Option<Spawner>,
}

impl MembershipApplier {
    /// An applier for `config`'s models; `intake` hears of instances joining and leaving.
    pub(crate) fn new(
        config: &Config,
        namespace: Namespace,
        builder: Arc<PoolBuilder>,
        intake: Option<mpsc::UnboundedSender<IntakeInput>>,
        metrics: ControlMetrics,
    ) -> Self {
        Self {
            builder,
            namespace,
            default_model: config.discovery.default_model.clone(),
            configured: config.models.iter().map(|m| m.name.clone()).collect(),
            by_key: HashMap::new(),
            joins: 0,
            intake,
            metrics,
            spawner: None,
        }
    }

    /// From now on, new instances get health probes and new `policy: kv` models a sweeper
    /// (the ones present when the proxy started got theirs from [`crate::Proxy::run`]).
    pub(crate) fn start_spawning(&mut self, spawner: Spawner) {
        self.spawner = Some(spawner);
    }

    /// Applies one watch event to `state`'s registry.
    pub(crate) async fn apply(&mut self, state: &Arc<State>, event: WatchEvent) {
        match event {
            WatchEvent::Put { key, record } => self.put(state, key, record).await,
            WatchEvent::Delete { key } => self.delete(state, &key),
            WatchEvent::Synced => self.metrics.discovery_connected.set(1),
            WatchEvent::Disconnected => {
                self.metrics.discovery_connected.set(0);
                self.metrics.discovery_errors.inc();
                tracing::warn!("discovery store unreachable: keeping the last known instances");
            }
        }
    }

    async fn put(&mut self, state: &Arc<State>, key: String, record: InstanceRecord) {
        if self
            .namespace
            .parse_instance_key(&key)
            .is_some_and(|(model, id)| model != record.model || id != record.instance_id)
        {
            tracing::warn!(%key, model = %record.model, "instance record does not match its key; ignored");
            return;
        }
        let spec = match instance_spec(&record).await {
            Ok(spec) => spec,
            Err(reason) => {
                self.metrics.discovery_errors.inc();
                tracing::warn!(%key, url = %record.url, %reason, "unusable instance record; ignored");
                return;
            }
        };
        let membership = membership(record.state);
        if let Some(known) = self.by_key.get(&key) {
            let same = known.id == spec.id
                && known.url == spec.url.as_str()
                && known.protocol == spec.protocol
                && known.record.block_size == record.block_size;
            if same && let Some(pool) = state.registry.get(&known.model) {
                if let Some(instance) = pool.instance(spec.id) {
                    if instance.membership() != membership {
                        tracing::info!(
                            model = %known.model,
                            instance = %instance.url(),
                            state = membership.label(),
                            "instance state changed"
                        );
                    }
                    instance.set_membership(membership);
                }
                if let Some(router) = pool.balancer().kv_router() {
                    router.set_capacity(spec.id, record.total_blocks, record.dp_ranks);
                }
                if known.adapters != spec.adapters {
                    tracing::info!(model = %known.model, instance = %spec.url, adapters = ?spec.adapters, "instance adapters changed");
                    pool.set_adapters(spec.id, spec.adapters.clone());
                    if let Some(known) = self.by_key.get_mut(&key) {
                        known.adapters = spec.adapters;
                    }
                }
                return;
            }
            self.delete(state, &key);
        }
        let Some(pool) = self.pool_for(state, &record) else {
            return;
        };
        fit_block_size(&pool, &record);
        let instance = self.builder.instance(pool.name(), &spec);
        if instance.is_unused_prefill_only(pool.disaggregation().is_some()) {
            tracing::warn!(
                model = %pool.name(),
                instance = %record.url,
                "the instance is registered prefill only (--role prefill) but its model has no \
                 disaggregation entry: it takes no requests (admin /health reports the model \
                 degraded); configure disaggregation for the model or register it --role both"
            );
        }
        instance.set_membership(membership);
        pool.add_instance(Arc::clone(&instance));
        pool.set_adapters(spec.id, spec.adapters.clone());
        if let Some(router) = pool.balancer().kv_router() {
            router.set_capacity(spec.id, record.total_blocks, record.dp_ranks);
        }
        if let Some(spawner) = &mut self.spawner {
            if let Some(health) = &spawner.health_check {
                spawn_probe(state, &instance, health, &mut spawner.tasks);
            }
            spawn_tokenizer_check(state, &pool, &instance, &mut spawner.tasks);
        }
        tracing::info!(
            model = %pool.name(),
            instance = %instance.url(),
            id = %record.instance_id,
            state = membership.label(),
            "instance joined"
        );
        self.count(&pool);
        self.feed_intake(&record, &pool);
        self.joins += 1;
        self.by_key.insert(
            key,
            Registered {
                model: pool.name().to_string(),
                id: spec.id,
                url: spec.url.to_string(),
                protocol: spec.protocol,
                adapters: spec.adapters,
                record,
                joined: self.joins,
            },
        );
    }

    /// Tells the intake that the record's instance takes its events into `pool`.
    fn feed_intake(&self, record: &InstanceRecord, pool: &Arc<ModelPool>) {
        if let Some(intake) = &self.intake {
            let snapshot_subject = if record.snapshot_subject.is_empty() {
                self.namespace.snapshot_subject(record.instance_id)
            } else {
                record.snapshot_subject.clone()
            };
            let _ = intake.send(IntakeInput::Joined {
                id: record.instance_id.0,
                pool: Arc::clone(pool),
                snapshot_subject,
                dp_ranks: record.dp_ranks,
            });
        }
    }

    /// After a reload swapped `old` for `reloaded.state`: the new pools get their sweepers
    /// (and probes for instances no old pool had), each registered instance whose model got
    /// a new pool has its block size fitted (in join order: the first sets an unset one) and
    /// its capacity set there, and its events moved there (the intake asks its
    /// agent for a snapshot), an instance whose model has no pool now is applied again
    /// (its model is then served with the discovery defaults), and the pools left behind
    /// are retired.
    pub(crate) async fn rehome(&mut self, old: &Arc<State>, reloaded: &Reloaded) {
        let new = &reloaded.state;
        self.configured.clone_from(&reloaded.configured);
        let old_pools = old.registry.pools();
        let new_pools = new.registry.pools();
        let kept = |pool: &Arc<ModelPool>, among: &[Arc<ModelPool>]| {
            among.iter().any(|other| Arc::ptr_eq(other, pool))
        };
        for pool in new_pools.iter().filter(|pool| !kept(pool, &old_pools)) {
            let Some(spawner) = &mut self.spawner else {
                break;
            };
            spawn_sweeper(pool, &mut spawner.tasks);
            if let Some(health) = &spawner.health_check {
                let known = |id: u64| old_pools.iter().any(|old| old.instance(id).is_some());
                for instance in pool.instances().iter().filter(|i| !known(i.id())) {
                    spawn_probe(new, instance, health, &mut spawner.tasks);
                }
            }
        }
        let mut keys: Vec<(u64, String)> = self
            .by_key
            .iter()
            .map(|(key, known)| (known.joined, key.clone()))
            .collect();
        keys.sort_unstable();
        for (_, key) in keys {
            let Some(known) = self.by_key.get(&key).cloned() else {
                continue;
            };
            let before = old.registry.get(&known.model);
            let after = new.registry.get(&known.model);
            if let (Some(before), Some(after)) = (&before, &after)
                && Arc::ptr_eq(before, after)
            {
                continue;
            }
            match after {
                Some(pool) if pool.instance(known.id).is_some() => {
                    fit_block_size(&pool, &known.record);
                    if let (Some(spawner), Some(instance)) =
                        (&mut self.spawner, pool.instance(known.id))
                    {
                        spawn_tokenizer_check(new, &pool, &instance, &mut spawner.tasks);
                    }
                    if let Some(router) = pool.balancer().kv_router() {
                        router.set_capacity(
                            known.id,
                            known.record.total_blocks,
                            known.record.dp_ranks,
                        );
                    }
                    self.count(&pool);
                    self.feed_intake(&known.record, &pool);
                }
                _ => {
                    self.by_key.remove(&key);
                    self.put(new, key, known.record).await;
                }
            }
        }
        for pool in old_pools.iter().filter(|pool| !kept(pool, &new_pools)) {
            pool.retire_except(|instance| {
                new_pools.iter().any(|new| {
                    new.instance(instance.id())
                        .is_some_and(|taken| Arc::ptr_eq(&taken, instance))
                })
            });
        }
        tracing::info!(
            models = new_pools.len(),
            "reload applied to the discovered instances"
        );
    }

    fn delete(&mut self, state: &Arc<State>, key: &str) {
        let Some(known) = self.by_key.remove(key) else {
            return;
        };
        if let Some(intake) = &self.intake {
            let _ = intake.send(IntakeInput::Left { id: known.id });
        }
        let Some(pool) = state.registry.get(&known.model) else {
            return;
        };
        if pool.remove_instance(known.id).is_some() {
            state.metrics.forget_instance(&known.model, &known.url);
            tracing::info!(model = %known.model, instance = %known.url, "instance left");
        }
        self.count(&pool);
        let registered = self.by_key.values().any(|other| other.model == known.model);
        if !registered
            && let Some(router) = pool.balancer().kv_router()
            && router.reset_block_size()
        {
            tracing::info!(model = %known.model, "no registered instance left: the next instance record sets the block size");
        }
        let configured = self.configured.contains(&known.model);
        if !configured && pool.instances().is_empty() {
            state.registry.remove(&known.model);
            tracing::info!(model = %known.model, "discovered model has no instance left: no longer served");
        }
    }

    fn count(&self, pool: &ModelPool) {
        let count = pool.instances().len();
        self.metrics
            .discovery_instances
            .with_label_values(&[pool.name()])
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// The pool of the record's model, created from the defaults when the config does not
    /// list it.
    fn pool_for(&mut self, state: &Arc<State>, record: &InstanceRecord) -> Option<Arc<ModelPool>> {
        if let Some(pool) = state.registry.get(&record.model) {
            return Some(pool);
        }
        if !self.default_model.enabled {
            tracing::debug!(model = %record.model, "instance of an unlisted model ignored (discovery.default_model.enabled: false)");
            return None;
        }
        let spec = default_model_spec(&self.default_model, record);
        let pool = match self.builder.pool(&spec) {
            Ok(pool) => pool,
            Err(error) => {
                self.metrics.discovery_errors.inc();
                tracing::warn!(model = %record.model, %error, "cannot serve the discovered model");
                return None;
            }
        };
        if !state.registry.insert(Arc::clone(&pool)) {
            return state.registry.get(&record.model);
        }
        tracing::info!(model = %record.model, policy = spec.policy.as_str(), "serving a discovered model");
        if let Some(spawner) = &mut self.spawner {
            spawn_sweeper(&pool, &mut spawner.tasks);
        }
        Some(pool)
    }
}

/// What a record's state means for routing.
fn membership(state: InstanceState) -> Membership {
    match state {
        InstanceState::Ready => Membership::Ready,
        InstanceState::NotReady => Membership::NotReady,
        InstanceState::Draining => Membership::Draining,
    }
}

/// The instance a record describes (its host resolved without blocking the runtime).
async fn instance_spec(record: &InstanceRecord) -> Result<InstanceSpec, String> {
    let url = BackendUrl::parse(&record.url).map_err(|error| error.to_string())?;
    let protocol = match record.protocol.as_str() {
        "" | "http1" => Protocol::Http1,
        "h2c" | "http2" => Protocol::H2c,
        other => return Err(format!("unknown protocol {other:?}")),
    };
    let host = url.host().trim_start_matches('[').trim_end_matches(']');
    let address = tokio::net::lookup_host((host, url.port()))
        .await
        .map_err(|error| error.to_string())?
        .next()
        .ok_or_else(|| "no address".to_string())?;
    let role = match record.role {
        InstanceRole::Both => Role::Both,
        InstanceRole::Prefill => Role::Prefill,
        InstanceRole::Decode => Role::Decode,
    };
    Ok(InstanceSpec {
        id: record.instance_id.0,
        url,
        address,
        protocol,
        adapters: record.adapters.clone(),
        role,
        pool: record.labels.get("pool").cloned(),
        dp_ranks: record.dp_ranks,
        // Its agent's `--labels bootstrap_port=…` (an SGLang prefill engine's).
        bootstrap_port: record
            .labels
            .get("bootstrap_port")
            .and_then(|port| port.parse().ok()),
    })
}

/// Fits the block size of the record's engine to `pool`'s model (`policy: kv`): an unset
/// one is taken from it; another than the model's is a conflict, logged loudly (the instance
/// is then scored by predictions alone, and reported by `/health` and a gauge).
fn fit_block_size(pool: &ModelPool, record: &InstanceRecord) {
    let Some(router) = pool.balancer().kv_router() else {
        return;
    };
    match router.fit_block_size(record.instance_id.0, u64::from(record.block_size)) {
        BlockSizeFit::Adopted => tracing::info!(
            model = %pool.name(),
            instance = %record.url,
            block_size = record.block_size,
            "kv.block_size unset: the model takes the block size of its first instance record"
        ),
        BlockSizeFit::Matches => {}
        BlockSizeFit::Differs { model } => tracing::warn!(
            model = %pool.name(),
            instance = %record.url,
            engine_block_size = record.block_size,
            kv_block_size = model,
            "the engine's KV block size differs from its model's: its KV events cannot match, \
             so it is scored by predictions alone (admin /health reports the model degraded); \
             run every engine of a model with one block size, or set kv.block_size to theirs"
        ),
    }
}

/// A discovered model's settings: the defaults, with the engine's block size (else
/// `default_model.kv.block_size`, else 16).
fn default_model_spec(defaults: &DefaultModelConfig, record: &InstanceRecord) -> ModelSpec {
    let block_size = usize::try_from(record.block_size)
        .ok()
        .filter(|&size| size > 0)
        .unwrap_or_else(|| defaults.kv.block_size_or_fallback());
    ModelSpec {
        name: record.model.clone(),
        aliases: Vec::new(),
        policy: defaults.effective_policy(),
        tokenizer: defaults.tokenizer.clone(),
        forward_token_ids: false,
        kv: KvRoutingConfig {
            block_size: Some(block_size),
            ..defaults.kv.clone()
        },
        migration_limit: defaults.migration_limit.unwrap_or(DEFAULT_MIGRATION_LIMIT),
        disaggregation: None,
        pools: Vec::new(),
        instances: Vec::new(),
    }
}

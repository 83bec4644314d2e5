//! Building instances and model pools from what a discovery source reports: at startup for
//! the config's models, and at run time for instances and models that discovery adds.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use kvmesh_preprocess::ModelPreprocessor;
use kvmesh_route::Balancer;
use kvmesh_route::kv::KvRouter;

use crate::edge::error::ProxyError;
use crate::engines::discovery::{InstanceSpec, ModelSpec};
use crate::engines::instance::{Instance, PeerSettings};
use crate::engines::pool::ModelPool;
use crate::metrics::families::Metrics;

/// Builds instances and pools; loads each tokenizer directory once.
#[derive(Debug)]
pub(crate) struct PoolBuilder {
    metrics: Metrics,
    settings: PeerSettings,
    /// Whether `policy: kv` models take their cached blocks from KV events.
    kv_events: bool,
    tokenizers: Mutex<HashMap<PathBuf, Arc<ModelPreprocessor>>>,
}

impl PoolBuilder {
    /// A builder registering metrics in `metrics`; `kv_events` says whether KV events feed
    /// the index of `policy: kv` models.
    pub(crate) fn new(metrics: Metrics, settings: PeerSettings, kv_events: bool) -> Self {
        Self {
            metrics,
            settings,
            kv_events,
            tokenizers: Mutex::default(),
        }
    }

    /// An instance of `model` as `spec` describes it.
    pub(crate) fn instance(&self, model: &str, spec: &InstanceSpec) -> Arc<Instance> {
        let handles = self.metrics.instance(model, spec.url.as_str());
        Arc::new(
            Instance::new(
                spec.id,
                spec.url.clone(),
                spec.address,
                spec.protocol,
                self.settings,
                handles,
                spec.role,
            )
            .in_pool(spec.pool.clone())
            .with_dp_ranks(spec.dp_ranks)
            .with_bootstrap_port(spec.bootstrap_port),
        )
    }

    /// The pool of `model` over its listed instances.
    pub(crate) fn pool(&self, model: &ModelSpec) -> Result<Arc<ModelPool>, ProxyError> {
        let instances: Vec<Arc<Instance>> = model
            .instances
            .iter()
            .map(|spec| self.instance(&model.name, spec))
            .collect();
        let balancer = self.balancer(model)?;
        let pool = ModelPool::new(
            model.name.clone(),
            instances,
            balancer,
            self.metrics.model(&model.name),
            model.migration_limit,
            model.disaggregation.clone(),
        )
        .with_pools(model.pools.clone());
        for spec in &model.instances {
            pool.set_adapters(spec.id, spec.adapters.clone());
        }
        Ok(Arc::new(pool))
    }

    /// Loads the tokenizer in `dir` (once per directory).
    pub(crate) fn tokenizer(
        &self,
        model: &str,
        dir: &Path,
    ) -> Result<Arc<ModelPreprocessor>, ProxyError> {
        let mut cache = self
            .tokenizers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(loaded) = cache.get(dir) {
            return Ok(Arc::clone(loaded));
        }
        let loaded = load_tokenizer(dir).map_err(|reason| ProxyError::Tokenizer {
            model: model.to_string(),
            dir: dir.display().to_string(),
            reason,
        })?;
        cache.insert(dir.to_path_buf(), Arc::clone(&loaded));
        Ok(loaded)
    }

    /// The model's balancer: its policy, or a KV router (loading its tokenizer).
    fn balancer(&self, model: &ModelSpec) -> Result<Balancer, ProxyError> {
        if let Some(balancer) = Balancer::load_only(model.policy) {
            return Ok(balancer);
        }
        let tokenizer = match &model.tokenizer {
            Some(dir) => Some(self.tokenizer(&model.name, dir)?),
            None => {
                tracing::warn!(
                    model = %model.name,
                    "policy kv without a tokenizer: chat requests and text prompts are routed by \
                     load alone (set `tokenizer: DIR`)"
                );
                None
            }
        };
        let router = KvRouter::new(
            &model.kv,
            tokenizer,
            model.forward_token_ids,
            self.kv_events,
            self.metrics.kv(&model.name),
        )
        .map_err(|error| ProxyError::KvSettings {
            model: model.name.clone(),
            reason: error.to_string(),
        })?;
        Ok(Balancer::Kv(Box::new(router)))
    }
}

/// Token ids the tokenizer's segment cache keeps per model (about 5 bytes each: ~10 MB), so
/// the history of multi-turn conversations is not tokenized again on every turn.
const SEGMENT_CACHE_TOKENS: usize = 2_000_000;

/// Loads a tokenizer directory, with the segment cache on.
pub(crate) fn load_tokenizer(dir: &Path) -> Result<Arc<ModelPreprocessor>, String> {
    let loaded = ModelPreprocessor::from_dir(dir).map_err(|error| error.to_string())?;
    Ok(Arc::new(loaded.with_segment_cache(SEGMENT_CACHE_TOKENS)))
}

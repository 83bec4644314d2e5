//! A model's pool: its instances, its policy and its metric handles, built once.

use std::sync::Arc;

use crate::clock::now_millis;
use crate::instance::Instance;
use crate::metrics::ModelMetrics;
use crate::policy::{Candidates, Excluded, Policy};

/// Everything the request path needs for one model.
#[derive(Debug)]
pub(crate) struct ModelPool {
    name: String,
    instances: Vec<Arc<Instance>>,
    policy: Box<dyn Policy>,
    metrics: ModelMetrics,
}

impl ModelPool {
    /// A pool over `instances`.
    pub(crate) fn new(
        name: String,
        instances: Vec<Arc<Instance>>,
        policy: Box<dyn Policy>,
        metrics: ModelMetrics,
    ) -> Self {
        Self {
            name,
            instances,
            policy,
            metrics,
        }
    }

    /// Canonical model name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The instances.
    pub(crate) fn instances(&self) -> &[Arc<Instance>] {
        &self.instances
    }

    /// Metric handles.
    pub(crate) fn metrics(&self) -> &ModelMetrics {
        &self.metrics
    }

    /// Picks an available instance not in `excluded`.
    pub(crate) fn pick(&self, excluded: &Excluded) -> Option<(usize, &Arc<Instance>)> {
        let candidates = Candidates::new(&self.instances, excluded, now_millis());
        let index = self.policy.pick(&candidates)?;
        self.instances.get(index).map(|instance| (index, instance))
    }

    /// Seconds a client should wait before retrying when nothing is available:
    /// until the first ejection ends, or one health-check interval.
    pub(crate) fn retry_after_secs(&self, health_interval_ms: u64) -> u64 {
        let now = now_millis();
        let wait_ms = self
            .instances
            .iter()
            .filter(|i| i.is_healthy())
            .map(|i| i.ejection_remaining_ms(now))
            .filter(|&ms| ms > 0)
            .min()
            .unwrap_or(health_interval_ms);
        wait_ms.div_ceil(1_000).max(1)
    }
}

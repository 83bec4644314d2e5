//! A model's pool: its instances, how it balances them and its metric handles, built once.

use std::sync::Arc;

use crate::clock::now_millis;
use crate::instance::Instance;
use crate::kv_route::KvRouter;
use crate::metrics::ModelMetrics;
use crate::policy::{Candidates, Excluded, Policy};

/// How a model spreads requests over its instances.
#[derive(Debug)]
pub(crate) enum Balancer {
    /// A policy that looks at the instances only.
    Policy(Box<dyn Policy>),
    /// `policy: kv`, which looks at each request's prompt too.
    Kv(Box<KvRouter>),
}

/// Everything the request path needs for one model.
#[derive(Debug)]
pub(crate) struct ModelPool {
    name: String,
    instances: Vec<Arc<Instance>>,
    balancer: Balancer,
    metrics: ModelMetrics,
}

impl ModelPool {
    /// A pool over `instances`.
    pub(crate) fn new(
        name: String,
        instances: Vec<Arc<Instance>>,
        balancer: Balancer,
        metrics: ModelMetrics,
    ) -> Self {
        Self {
            name,
            instances,
            balancer,
            metrics,
        }
    }

    /// How it balances.
    pub(crate) fn balancer(&self) -> &Balancer {
        &self.balancer
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

    /// Picks an available instance not in `excluded` with `policy`.
    pub(crate) fn pick(
        &self,
        policy: &dyn Policy,
        excluded: &Excluded,
    ) -> Option<(usize, &Arc<Instance>)> {
        let candidates = Candidates::new(&self.instances, excluded, now_millis());
        let index = policy.pick(&candidates)?;
        self.instances.get(index).map(|instance| (index, instance))
    }

    /// Copies live state into the pool's gauges (called before a scrape).
    pub(crate) fn refresh_gauges(&self) {
        let now = now_millis();
        for instance in &self.instances {
            instance.refresh_gauges(now);
        }
        if let Balancer::Kv(router) = &self.balancer {
            router.refresh_gauges();
        }
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

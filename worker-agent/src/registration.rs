//! Registration in the registry: the instance record under a lease kept alive at a third of
//! its TTL, rewritten when the state or the engine's facts (adapters, KV capacity) change, and written again under a new lease when the old
//! one is lost (etcd restarted without its data, or unreachable longer than the TTL).

use std::sync::Arc;
use std::time::Duration;

use kvmesh_control::{ControlError, InstanceRecord, InstanceState, LeaseId, Registry};
use kvmesh_telemetry::Tracer;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use tokio::sync::watch;

use crate::engine_facts::EngineFacts;
use crate::metrics::AgentMetrics;
use crate::trace::AgentSpan;

/// Retry pause after a failed registration attempt.
const RETRY: Duration = Duration::from_millis(500);

/// The registration task's inputs.
pub(crate) struct Registration {
    /// Where to register.
    pub registry: Arc<dyn Registry>,
    /// The record's key.
    pub key: String,
    /// The record (its `state`, `adapters` and `total_blocks` are replaced by the current
    /// ones).
    pub record: InstanceRecord,
    /// The engine's facts, as last read.
    pub facts: watch::Receiver<EngineFacts>,
    /// Lease TTL.
    pub ttl: Duration,
    /// Counters.
    pub metrics: AgentMetrics,
    /// Traces each registration (`None`: tracing is off).
    pub tracer: Option<Tracer>,
}

impl Registration {
    /// A span of registering the record (`name`), when tracing.
    fn span(&self, name: &'static str) -> AgentSpan {
        AgentSpan::start(self.tracer.as_ref(), name, SpanKind::Client, None, || {
            vec![
                KeyValue::new("kvmesh.registry.key", self.key.clone()),
                KeyValue::new("kvmesh.instance_id", self.record.instance_id.to_string()),
            ]
        })
    }

    async fn put(&self, state: InstanceState, lease: LeaseId) -> Result<(), ControlError> {
        let mut record = self.record.clone();
        record.state = state;
        {
            let facts = self.facts.borrow();
            record.adapters.clone_from(&facts.adapters);
            record.total_blocks = facts.total_blocks;
        }
        self.registry.put(&self.key, &record, Some(lease)).await
    }

    /// Runs until `stop` turns true, then revokes the lease. `desired` is the state to
    /// advertise; `written` reports the state actually registered (`None`: not registered).
    pub(crate) async fn run(
        mut self,
        mut desired: watch::Receiver<InstanceState>,
        written: watch::Sender<Option<InstanceState>>,
        mut stop: watch::Receiver<bool>,
    ) {
        let keep_alive_every = (self.ttl / 3).max(Duration::from_millis(100));
        loop {
            if *stop.borrow() {
                return;
            }
            let mut span = self.span("register");
            let lease = match self.registry.grant_lease(self.ttl).await {
                Ok(lease) => lease,
                Err(e) => {
                    span.fail(&e);
                    span.end();
                    tracing::warn!(error = %e, "cannot get a registry lease; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(RETRY) => continue,
                        _ = stop.changed() => return,
                    }
                }
            };
            let mut state = *desired.borrow_and_update();
            self.facts.mark_unchanged();
            span.set(|| KeyValue::new("kvmesh.instance_state", state.as_str()));
            let put = self.put(state, lease).await;
            if let Err(e) = &put {
                span.fail(e);
            }
            span.end();
            if let Err(e) = put {
                tracing::warn!(error = %e, "cannot register the instance; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(RETRY) => continue,
                    _ = stop.changed() => return,
                }
            }
            tracing::info!(key = %self.key, state = state.as_str(), "registered");
            written.send_replace(Some(state));
            self.metrics.registered.set(1);
            let mut dirty = false;
            let mut tick = tokio::time::interval(keep_alive_every);
            tick.tick().await;
            let lost = loop {
                tokio::select! {
                    _ = tick.tick() => {
                        match self.registry.keep_alive(lease).await {
                            Ok(_) => {}
                            Err(ControlError::LeaseNotFound(_)) => break true,
                            // Worth a warning: enough of these in a row and the lease, with
                            // the instance's record, lapses.
                            Err(e) => tracing::warn!(error = %e, "lease keep-alive failed"),
                        }
                    }
                    changed = desired.changed() => {
                        if changed.is_err() {
                            break false;
                        }
                        state = *desired.borrow_and_update();
                        dirty = true;
                    }
                    Ok(()) = self.facts.changed() => {
                        self.facts.mark_unchanged();
                        dirty = true;
                    }
                    _ = stop.changed() => {
                        if let Err(e) = self.registry.revoke(lease).await {
                            tracing::debug!(error = %e, "lease revoke failed");
                        }
                        tracing::info!(key = %self.key, "deregistered");
                        written.send_replace(None);
                        self.metrics.registered.set(0);
                        return;
                    }
                }
                if dirty {
                    match self.put(state, lease).await {
                        Ok(()) => {
                            dirty = false;
                            tracing::info!(state = state.as_str(), "instance record updated");
                            written.send_replace(Some(state));
                        }
                        Err(ControlError::LeaseNotFound(_)) => break true,
                        Err(e) => tracing::debug!(error = %e, "state update failed; retrying"),
                    }
                }
            };
            written.send_replace(None);
            self.metrics.registered.set(0);
            if !lost {
                return;
            }
            tracing::warn!(key = %self.key, "registry lease lost; registering again");
        }
    }
}

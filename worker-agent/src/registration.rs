//! Registration in the registry: the instance record under a lease kept alive at a third of
//! its TTL (on a task of its own, so that a slow record write never delays a renewal),
//! rewritten when the state or the engine's facts (adapters, KV capacity) change, and
//! written again under a new lease when the old one is lost (etcd restarted without its
//! data, or unreachable longer than the TTL).

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

/// Renews `lease` every `every` until the registry says it is gone.
async fn keep_alive(registry: Arc<dyn Registry>, lease: LeaseId, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tick.tick().await;
        match registry.keep_alive(lease).await {
            Ok(_) => {}
            Err(ControlError::LeaseNotFound(_)) => return,
            // Worth a warning: enough of these in a row and the lease, with the instance's
            // record, lapses.
            Err(e) => tracing::warn!(error = %e, "lease keep-alive failed"),
        }
    }
}

/// The renewal task of one lease, stopped when the lease is given up.
struct KeepAlive(tokio::task::JoinHandle<()>);

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.0.abort();
    }
}

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
            // Renewals run on their own task: a record write that etcd is slow to persist
            // (a WAL sync took 1.9 s on a loaded 2-core machine) must not hold them back.
            let mut keeper = KeepAlive(tokio::spawn(keep_alive(
                Arc::clone(&self.registry),
                lease,
                keep_alive_every,
            )));
            let lost = loop {
                tokio::select! {
                    _ = &mut keeper.0 => break true,
                    // A write that failed is tried again.
                    () = tokio::time::sleep(RETRY), if dirty => {}
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use async_trait::async_trait;
    use kvmesh_control::testing::instance_record;
    use kvmesh_control::{InProcessRegistry, Listing, Namespace, Watch};

    use super::*;

    /// A registry whose record writes after the first take `delay` (etcd persisting them on a
    /// slow disk), counting the leases it grants.
    struct SlowWrites {
        inner: InProcessRegistry,
        delay: Duration,
        puts: AtomicU32,
        grants: AtomicU32,
    }

    #[async_trait]
    impl Registry for SlowWrites {
        async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, ControlError> {
            self.grants.fetch_add(1, Ordering::Relaxed);
            self.inner.grant_lease(ttl).await
        }

        async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, ControlError> {
            self.inner.keep_alive(lease).await
        }

        async fn revoke(&self, lease: LeaseId) -> Result<(), ControlError> {
            self.inner.revoke(lease).await
        }

        async fn put(
            &self,
            key: &str,
            record: &InstanceRecord,
            lease: Option<LeaseId>,
        ) -> Result<(), ControlError> {
            if self.puts.fetch_add(1, Ordering::Relaxed) > 0 {
                tokio::time::sleep(self.delay).await;
            }
            self.inner.put(key, record, lease).await
        }

        async fn delete(&self, key: &str) -> Result<(), ControlError> {
            self.inner.delete(key).await
        }

        async fn list(&self, prefix: &str) -> Result<Listing, ControlError> {
            self.inner.list(prefix).await
        }

        fn watch(&self, prefix: &str) -> Watch {
            self.inner.watch(prefix)
        }
    }

    #[tokio::test]
    async fn a_slow_record_write_does_not_hold_back_the_lease_renewals() {
        const TTL: Duration = Duration::from_millis(300);
        let registry = Arc::new(SlowWrites {
            inner: InProcessRegistry::new(),
            // Over three TTLs: a renewal waiting for it would come too late.
            delay: Duration::from_secs(1),
            puts: AtomicU32::new(0),
            grants: AtomicU32::new(0),
        });
        let record = instance_record(&Namespace::default(), "m", 1);
        let key = "/kvmesh/instances/m/1".to_owned();
        let (_facts_tx, facts) = watch::channel(EngineFacts::default());
        let registration = Registration {
            registry: Arc::clone(&registry) as Arc<dyn Registry>,
            key: key.clone(),
            record,
            facts,
            ttl: TTL,
            metrics: AgentMetrics::new().unwrap(),
            tracer: None,
        };
        let (desired_tx, desired) = watch::channel(InstanceState::Ready);
        let (written_tx, mut written) = watch::channel(None);
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(registration.run(desired, written_tx, stop));
        let deadline = Duration::from_secs(5);
        tokio::time::timeout(
            deadline,
            written.wait_for(|w| *w == Some(InstanceState::Ready)),
        )
        .await
        .expect("registered")
        .unwrap();

        desired_tx.send_replace(InstanceState::NotReady);
        tokio::time::timeout(
            deadline,
            written.wait_for(|w| *w == Some(InstanceState::NotReady)),
        )
        .await
        .expect("the slow write done")
        .unwrap();
        assert_eq!(
            registry.grants.load(Ordering::Relaxed),
            1,
            "the lease lapsed during the write"
        );
        let listing = registry.list("/kvmesh/instances/").await.unwrap();
        assert_eq!(
            listing
                .records
                .iter()
                .map(|(k, r)| (k.as_str(), r.state))
                .collect::<Vec<_>>(),
            [(key.as_str(), InstanceState::NotReady)]
        );
        stop_tx.send_replace(true);
        tokio::time::timeout(deadline, task).await.unwrap().unwrap();
    }
}

//! Polling the engine's `/health`: two failures in a row make the instance `not_ready`, one
//! success makes it `ready` again; `draining` (set on shutdown) is never overridden.

use std::time::Duration;

use kvmesh_control::InstanceState;
use tokio::sync::watch;

use crate::http_client::EngineClient;
use crate::metrics::AgentMetrics;

/// Failed polls in a row before the instance is marked not ready.
const FAILURES_BEFORE_NOT_READY: u32 = 2;

/// One probe: whether `/health` answers 2xx within `timeout`.
pub(crate) async fn probe(engine: &EngineClient, timeout: Duration) -> bool {
    matches!(engine.get("/health", timeout).await, Ok((status, _)) if status.is_success())
}

/// Sets `state` from a probe result unless the instance is draining.
fn advertise(state: &watch::Sender<InstanceState>, healthy: bool) {
    let next = if healthy {
        InstanceState::Ready
    } else {
        InstanceState::NotReady
    };
    state.send_if_modified(|s| {
        if *s == InstanceState::Draining || *s == next {
            return false;
        }
        tracing::info!(state = next.as_str(), "engine health changed");
        *s = next;
        true
    });
}

/// Polls every `interval` until aborted.
/// `recovered` counts the engine's returns from unreachable (the KV event intakes then
/// reconnect: the engine may have restarted).
pub(crate) async fn run(
    engine: EngineClient,
    interval: Duration,
    state: watch::Sender<InstanceState>,
    recovered: watch::Sender<u64>,
    metrics: AgentMetrics,
) {
    let mut failures = 0u32;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = interval.max(Duration::from_millis(500));
    loop {
        tick.tick().await;
        if probe(&engine, timeout).await {
            if failures >= FAILURES_BEFORE_NOT_READY {
                recovered.send_modify(|returns| *returns += 1);
            }
            failures = 0;
            metrics.engine_healthy.set(1);
            advertise(&state, true);
        } else {
            failures += 1;
            metrics.engine_healthy.set(0);
            if failures >= FAILURES_BEFORE_NOT_READY {
                advertise(&state, false);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draining_is_never_overridden() {
        let (tx, rx) = watch::channel(InstanceState::Ready);
        advertise(&tx, false);
        assert_eq!(*rx.borrow(), InstanceState::NotReady);
        advertise(&tx, true);
        assert_eq!(*rx.borrow(), InstanceState::Ready);
        tx.send_replace(InstanceState::Draining);
        advertise(&tx, true);
        advertise(&tx, false);
        assert_eq!(*rx.borrow(), InstanceState::Draining);
    }
}

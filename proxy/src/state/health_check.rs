//! Active health checks: one background task per instance probing
//! `GET <url><path>` through the same connector as the traffic.

use std::sync::Arc;

use http::header;
use kvmesh_config::HealthCheckConfig;
use pingora_http::RequestHeader;
use tokio::task::JoinSet;
use tokio::time::{MissedTickBehavior, interval, timeout};

use crate::engines::health::HealthTracker;
use crate::engines::instance::{Instance, Membership};
use crate::engines::upstream_session::UpstreamSession;
use crate::state::shared::State;

/// Spawns a probe task for every instance of every model into `tasks`.
pub(crate) fn spawn_probes(
    state: &Arc<State>,
    config: &Arc<HealthCheckConfig>,
    tasks: &mut JoinSet<()>,
) {
    for pool in state.registry.pools() {
        for instance in pool.instances().iter() {
            spawn_probe(state, instance, config, tasks);
        }
    }
}

/// Spawns the probe task of `instance` into `tasks`; it ends when the instance leaves its
/// pool.
pub(crate) fn spawn_probe(
    state: &Arc<State>,
    instance: &Arc<Instance>,
    config: &Arc<HealthCheckConfig>,
    tasks: &mut JoinSet<()>,
) {
    tasks.spawn(probe_loop(
        Arc::clone(state),
        Arc::clone(instance),
        Arc::clone(config),
    ));
}

async fn probe_loop(state: Arc<State>, instance: Arc<Instance>, config: Arc<HealthCheckConfig>) {
    let mut tracker = HealthTracker::new(config.healthy_threshold, config.unhealthy_threshold);
    let mut ticks = interval(config.interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if instance.membership() == Membership::Removed {
            return;
        }
        let result = match timeout(config.timeout, probe(&state, &instance, &config.path)).await {
            Ok(result) => result,
            Err(_) => Err(format!("no answer within {:?}", config.timeout)),
        };
        if let Err(reason) = &result {
            tracing::debug!(instance = %instance.url(), %reason, "health probe failed");
        }
        if let Some(healthy) = tracker.observe(result.is_ok()) {
            instance.set_healthy(healthy);
            if healthy {
                tracing::info!(instance = %instance.url(), "instance healthy");
            } else {
                tracing::warn!(
                    instance = %instance.url(),
                    reason = result.err().unwrap_or_default(),
                    "instance unhealthy"
                );
            }
        }
    }
}

/// One probe: `Ok` on a 2xx answer.
async fn probe(state: &State, instance: &Instance, path: &str) -> Result<(), String> {
    let (mut session, _) = state
        .upstream
        .session(instance.peer())
        .await
        .map_err(|error| error.to_string())?;
    let mut request =
        RequestHeader::build("GET", path.as_bytes(), Some(2)).map_err(|e| e.to_string())?;
    request
        .insert_header(header::HOST, instance.host_header().clone())
        .and_then(|()| request.insert_header(header::USER_AGENT, "kvmesh-health-check"))
        .map_err(|error| error.to_string())?;
    session
        .write_request_header(Box::new(request))
        .await
        .map_err(|error| error.to_string())?;
    session
        .finish_request_body()
        .await
        .map_err(|error| error.to_string())?;
    session
        .read_response_header()
        .await
        .map_err(|error| error.to_string())?;
    let status = session
        .response_header()
        .map(|header| header.status)
        .ok_or("no response header")?;
    while session
        .read_response_body()
        .await
        .map_err(|error| error.to_string())?
        .is_some()
    {}
    state
        .upstream
        .release(UpstreamSession::Pingora(Box::new(session)), instance.peer())
        .await;
    if status.is_success() {
        Ok(())
    } else {
        Err(format!("status {status}"))
    }
}

/// Time between probes, for `Retry-After` hints.
pub(crate) fn interval_ms(config: &HealthCheckConfig) -> u64 {
    u64::try_from(config.interval.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn interval_is_in_milliseconds() {
        let config = HealthCheckConfig {
            interval: Duration::from_millis(1500),
            ..HealthCheckConfig::default()
        };
        assert_eq!(interval_ms(&config), 1500);
    }
}

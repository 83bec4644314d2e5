//! The background task of each `policy: kv` model: drops bookings older than
//! `kv.stale_request_timeout` and predictions past their TTL, every
//! `stale_request_timeout / 10` (between 1 s and 30 s).

use std::sync::Arc;
use std::time::Instant;

use tokio::task::JoinSet;
use tokio::time::{MissedTickBehavior, interval};

use crate::pool::{Balancer, ModelPool};
use crate::state::State;

/// Spawns a sweeper for every `policy: kv` model into `tasks`.
pub(crate) fn spawn_sweepers(state: &State, tasks: &mut JoinSet<()>) {
    for pool in state.registry.pools() {
        if matches!(pool.balancer(), Balancer::Kv(_)) {
            tasks.spawn(sweep_loop(Arc::clone(pool)));
        }
    }
}

async fn sweep_loop(pool: Arc<ModelPool>) {
    let Balancer::Kv(router) = pool.balancer() else {
        return;
    };
    let mut ticks = interval(router.sweep_interval());
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        router.sweep(Instant::now());
    }
}

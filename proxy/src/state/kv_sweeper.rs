//! The background task of each `policy: kv` model: drops bookings older than
//! `kv.stale_request_timeout` and predictions past their TTL, every
//! `stale_request_timeout / 10` (between 1 s and 30 s), until the model leaves the registry.

use std::sync::Arc;
use std::time::Instant;

use tokio::task::JoinSet;
use tokio::time::{MissedTickBehavior, interval};

use crate::engines::pool::ModelPool;
use crate::state::shared::State;

/// Spawns a sweeper for every `policy: kv` model into `tasks`.
pub(crate) fn spawn_sweepers(state: &State, tasks: &mut JoinSet<()>) {
    for pool in state.registry.pools() {
        spawn_sweeper(&pool, tasks);
    }
}

/// Spawns the sweeper of `pool` into `tasks` when it uses `policy: kv`; it ends when the
/// pool leaves the registry.
pub(crate) fn spawn_sweeper(pool: &Arc<ModelPool>, tasks: &mut JoinSet<()>) {
    if pool.balancer().kv_router().is_some() {
        tasks.spawn(sweep_loop(Arc::clone(pool)));
    }
}

async fn sweep_loop(pool: Arc<ModelPool>) {
    let Some(router) = pool.balancer().kv_router() else {
        return;
    };
    let mut ticks = interval(router.sweep_interval());
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if pool.is_retired() {
            return;
        }
        router.sweep(Instant::now());
    }
}

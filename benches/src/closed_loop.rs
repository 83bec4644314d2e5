//! Closed loop: a fixed number of lanes, each sending its next request as soon as the previous
//! one has finished.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tokio::task::JoinSet;

use crate::client::Client;
use crate::lane::{Attempt, Lane};
use crate::plan::{DriverError, Outcome, Plan, Schedule};
use crate::recorder::Recorder;
use crate::workload::Workload;

/// Counters shared by the lanes of one closed-loop run.
#[derive(Debug, Default)]
struct Counters {
    next_index: AtomicU64,
    measured: AtomicU64,
}

/// Runs `concurrency` lanes back to back until the plan's stop condition.
pub async fn run_closed_loop(
    client: Arc<Client>,
    workload: Arc<dyn Workload>,
    concurrency: usize,
    plan: Plan,
) -> Result<Outcome, DriverError> {
    let schedule = plan.start();
    let counters = Arc::new(Counters::default());
    let mut lanes = JoinSet::new();
    for _ in 0..concurrency {
        let lane = Lane::new(client.clone());
        lanes.spawn(drive_lane(
            lane,
            workload.clone(),
            counters.clone(),
            plan,
            schedule,
        ));
    }
    let mut recorder = Recorder::new();
    while let Some(lane) = lanes.join_next().await {
        recorder.merge(lane?.recorder());
    }
    Ok(Outcome::new(&plan, &schedule, recorder))
}

async fn drive_lane(
    mut lane: Lane,
    workload: Arc<dyn Workload>,
    counters: Arc<Counters>,
    plan: Plan,
    schedule: Schedule,
) -> Lane {
    loop {
        let now = Instant::now();
        if schedule.cutoff.is_some_and(|cutoff| now >= cutoff) {
            break;
        }
        let record = now >= schedule.measure_from;
        if record
            && let Some(limit) = plan.request_limit()
            && counters.measured.fetch_add(1, Ordering::Relaxed) >= limit
        {
            break;
        }
        let index = counters.next_index.fetch_add(1, Ordering::Relaxed);
        let Some(item) = workload.item(index) else {
            break;
        };
        let attempt = Attempt {
            origin: now,
            record,
            cutoff: schedule.cutoff,
        };
        lane.run(&item, attempt).await;
    }
    lane
}

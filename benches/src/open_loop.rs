//! Open loop: requests arrive on a schedule (Poisson, or fixed offsets from a trace) whatever
//! the server's pace, with a bound on how many may be outstanding.
//!
//! Arrival times come from a timer on a blocking thread (`std::thread::sleep`, tens of µs of
//! jitter) rather than the runtime's millisecond timer wheel, which would bunch arrivals into
//! per-millisecond bursts.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::arrival::ArrivalPlan;
use crate::client::Client;
use crate::lane::{Attempt, Lane};
use crate::plan::{DriverError, Outcome, Plan, Schedule};
use crate::recorder::Recorder;
use crate::workload::Workload;

/// Dispatch later than this after the scheduled arrival counts as backlog: latency is then
/// measured from the scheduled time, so the delay shows. Within it, from the actual dispatch
/// (timer jitter is not the server's latency).
const TIMER_SLACK: Duration = Duration::from_millis(1);
/// Arrivals the timer may run ahead of the dispatcher.
const ARRIVAL_QUEUE: usize = 65_536;

/// Shape of an open-loop run.
#[derive(Debug, Clone)]
pub struct OpenLoop {
    /// When requests arrive.
    pub arrivals: ArrivalPlan,
    /// Most requests in flight at once; arrivals beyond wait (and their wait counts as latency).
    pub max_outstanding: usize,
}

/// One scheduled arrival.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    at: Instant,
    record: bool,
}

/// Sends requests at Poisson arrival times until the plan's stop condition.
pub async fn run_open_loop(
    client: Arc<Client>,
    workload: Arc<dyn Workload>,
    shape: OpenLoop,
    plan: Plan,
) -> Result<Outcome, DriverError> {
    let schedule = plan.start();
    let (arrivals_tx, mut arrivals) = mpsc::channel(ARRIVAL_QUEUE);
    let max_outstanding = shape.max_outstanding;
    let timer = tokio::task::spawn_blocking(move || {
        emit_arrivals(&shape.arrivals, plan, schedule, Instant::now(), arrivals_tx)
    });
    let idle: Arc<Mutex<Vec<Lane>>> = Arc::new(Mutex::new(Vec::new()));
    let mut in_flight = JoinSet::new();
    let mut index = 0u64;
    while let Some(arrival) = arrivals.recv().await {
        let Some(item) = workload.item(index) else {
            break;
        };
        index += 1;
        while in_flight.len() >= max_outstanding {
            if let Some(done) = in_flight.join_next().await {
                done?;
            }
        }
        while let Some(done) = in_flight.try_join_next() {
            done?;
        }
        let now = Instant::now();
        let origin = if now.saturating_duration_since(arrival.at) <= TIMER_SLACK {
            now
        } else {
            arrival.at
        };
        let mut lane = take_lane(&idle).unwrap_or_else(|| Lane::new(client.clone()));
        let idle = idle.clone();
        let attempt = Attempt {
            origin,
            record: arrival.record,
            cutoff: schedule.cutoff,
        };
        in_flight.spawn(async move {
            lane.run(&item, attempt).await;
            idle.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(lane);
        });
    }
    drop(arrivals);
    timer.await?;
    while let Some(done) = in_flight.join_next().await {
        done?;
    }
    let mut recorder = Recorder::new();
    for lane in idle.lock().unwrap_or_else(PoisonError::into_inner).iter() {
        recorder.merge(lane.recorder());
    }
    Ok(Outcome::new(&plan, &schedule, recorder))
}

/// Sleeps until each arrival and sends it; stops at the plan's end, at the end of a finite
/// arrival plan, or when the receiver is gone.
fn emit_arrivals(
    arrivals_plan: &ArrivalPlan,
    plan: Plan,
    schedule: Schedule,
    start: Instant,
    arrivals: mpsc::Sender<Arrival>,
) {
    let mut measured = 0u64;
    for offset in arrivals_plan.times() {
        let next = start + offset;
        if schedule.cutoff.is_some_and(|cutoff| next >= cutoff) {
            return;
        }
        let record = next >= schedule.measure_from;
        if record && let Some(limit) = plan.request_limit() {
            if measured >= limit {
                return;
            }
            measured += 1;
        }
        let wait = next.saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        let arrival = Arrival { at: next, record };
        if arrivals.blocking_send(arrival).is_err() {
            return;
        }
    }
}

fn take_lane(idle: &Mutex<Vec<Lane>>) -> Option<Lane> {
    idle.lock().unwrap_or_else(PoisonError::into_inner).pop()
}

//! When a run measures and when it stops, and what it measured.

use std::time::{Duration, Instant};

use crate::recorder::Recorder;

/// When the measured part of a run ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// After this long (responses still in flight then are not counted).
    After(Duration),
    /// After this many measured requests have completed.
    Requests(u64),
}

/// Warm-up and stop condition of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Load is applied but nothing is recorded for this long first.
    pub warmup: Duration,
    /// When measuring ends.
    pub stop: Stop,
}

/// The clock of one run, fixed when it starts.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    /// Requests issued (closed loop) or scheduled (open loop) from here on are recorded.
    pub measure_from: Instant,
    /// End of the measurement window for duration-bound runs.
    pub cutoff: Option<Instant>,
}

impl Plan {
    /// The schedule of a run starting now.
    pub fn start(&self) -> Schedule {
        let measure_from = Instant::now() + self.warmup;
        let cutoff = match self.stop {
            Stop::After(duration) => Some(measure_from + duration),
            Stop::Requests(_) => None,
        };
        Schedule {
            measure_from,
            cutoff,
        }
    }

    /// The request budget of a count-bound run.
    pub fn request_limit(&self) -> Option<u64> {
        match self.stop {
            Stop::After(_) => None,
            Stop::Requests(n) => Some(n),
        }
    }
}

/// What a run measured over its window.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Everything recorded, merged over all lanes.
    pub recorder: Recorder,
    /// Length of the measurement window.
    pub window: Duration,
}

impl Outcome {
    /// The outcome of a run: the window is the planned duration, or from the start of
    /// measurement to the last measured completion for a count-bound run.
    pub fn new(plan: &Plan, schedule: &Schedule, recorder: Recorder) -> Self {
        let window = match plan.stop {
            Stop::After(duration) => duration,
            Stop::Requests(_) => recorder
                .last_finish
                .map(|last| last.saturating_duration_since(schedule.measure_from))
                .unwrap_or_default(),
        };
        Self { recorder, window }
    }
}

/// A load task that panicked.
#[derive(Debug, thiserror::Error)]
#[error("a load task failed: {0}")]
pub struct DriverError(#[from] pub tokio::task::JoinError);

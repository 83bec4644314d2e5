//! TensorRT-LLM's KV cache events: trtllm-serve's `POST /kv_cache_events` polled every
//! interval, one request at a time (a poll empties the engine's queue), decoded and turned
//! into engine events by `kvmesh-engine-events` ([`decode_trtllm_events`], [`TrtllmView`]),
//! numbered per attention-DP rank by `event_id` ([`SeqTracker`]) and translated into the core.
//!
//! There is no replay: events lost to a full engine queue (`event_buffer_max_size`), to
//! another poller, or to an answer the agent could not read show as a jump in `event_id`, and
//! the agent's view stays incomplete (`kvmesh_agent_kv_events_complete` 0, carried to the
//! proxies by the load reports) until the engine clears its cache or restarts: `event_id`
//! back to 0, or a `created` after blocks were seen.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_engine_events::{
    EngineBatch, EngineEvent, TrtllmData, TrtllmView, decode_trtllm_events,
};
use tokio::sync::oneshot;

use super::sequence::{SeqAction, SeqTracker};
use crate::core::Core;
use crate::http_client::EngineClient;
use crate::metrics::AgentMetrics;

/// The route trtllm-serve serves its KV cache events on.
const PATH: &str = "/kv_cache_events";
/// Longest a poll may take: older servers wait up to 2 s for events before answering.
const POLL_TIMEOUT: Duration = Duration::from_secs(10);

/// The events of the polls so far: the view, and each rank's last `event_id`.
pub(crate) struct TrtllmIntake {
    view: TrtllmView,
    trackers: BTreeMap<u32, SeqTracker>,
    core: Arc<Core>,
    metrics: AgentMetrics,
    /// Ranks seen whose events the core has no table for (`--dp-ranks` too small): warned
    /// once each.
    warned_ranks: Vec<u32>,
}

impl TrtllmIntake {
    /// An intake of `block_size`-token blocks into `core`.
    pub(crate) fn new(block_size: usize, core: Arc<Core>, metrics: AgentMetrics) -> Self {
        Self {
            view: TrtllmView::new(block_size),
            trackers: BTreeMap::new(),
            core,
            metrics,
            warned_ranks: Vec::new(),
        }
    }

    /// Applies one answer of `POST /kv_cache_events`, received at `received`.
    pub(crate) fn apply(&mut self, body: &[u8], received: Instant) {
        let m = &self.metrics;
        let poll = match decode_trtllm_events(body) {
            Ok(poll) => poll,
            Err(why) => {
                // Its events are gone from the engine's queue: the next numbers show the gap.
                m.malformed.inc();
                tracing::warn!(%why, "unreadable answer of the engine's /kv_cache_events");
                return;
            }
        };
        if let Some(why) = &poll.malformed_reason {
            m.dropped
                .with_label_values(&["malformed_event"])
                .inc_by(poll.malformed_events as u64);
            tracing::debug!(skipped = poll.malformed_events, %why, "skipping malformed KV events");
        }
        let mut pending: BTreeMap<u32, Vec<EngineEvent>> = BTreeMap::new();
        for event in &poll.events {
            let rank = event.dp_rank;
            let tracker = self.trackers.entry(rank).or_default();
            let id = event.event_id;
            match tracker.check(id) {
                SeqAction::Apply => {}
                SeqAction::Skip => {
                    // A poll takes each event once: a number already seen is a restarted
                    // engine's whose first events (with its `created`) were lost.
                    tracing::warn!(
                        rank,
                        event_id = id,
                        last = tracker.last(),
                        "engine event ids went back: a restarted engine whose first KV events \
                         were lost; forgetting its blocks, the agent's view is incomplete"
                    );
                    *tracker = SeqTracker::default();
                    self.view.restart(rank);
                    pending.entry(rank).or_default().push(EngineEvent::Cleared);
                    m.engine_seq_gaps.inc();
                    m.events_complete.set(0);
                }
                SeqAction::Restart => {
                    tracing::info!(rank, "engine event ids restarted: forgetting its blocks");
                    self.view.restart(rank);
                    pending.entry(rank).or_default().push(EngineEvent::Cleared);
                    m.events_complete.set(1);
                }
                SeqAction::CatchUp { from } | SeqAction::Gap { from } => {
                    m.engine_seq_gaps.inc();
                    tracing::warn!(
                        rank,
                        from,
                        until = id,
                        "KV events were lost (the engine's queue overflowed, or another client \
                         polled it): the agent's view is incomplete until the engine restarts"
                    );
                    m.events_complete.set(0);
                }
            }
            tracker.applied(id);
            let step = self.view.translate(event);
            if matches!(event.data, TrtllmData::Created { .. }) {
                tracing::info!(
                    rank,
                    window = ?self.view.window(),
                    gpu_blocks = ?self.view.capacity(),
                    "the engine made its KV cache"
                );
            }
            if step.partial_blocks > 0 {
                m.dropped
                    .with_label_values(&["partial_block"])
                    .inc_by(step.partial_blocks as u64);
            }
            if let Some(event) = step.event {
                if event == EngineEvent::Cleared {
                    m.events_complete.set(1);
                }
                pending.entry(rank).or_default().push(event);
            }
        }
        for (rank, events) in pending {
            if rank >= self.core.dp_ranks() {
                if !self.warned_ranks.contains(&rank) {
                    self.warned_ranks.push(rank);
                    tracing::warn!(
                        rank,
                        dp_ranks = self.core.dp_ranks(),
                        "KV events of an attention-DP rank past --dp-ranks are dropped"
                    );
                }
                continue;
            }
            let batch = EngineBatch {
                ts: 0.0,
                dp_rank: Some(rank),
                events,
                malformed_events: 0,
                malformed_reason: None,
            };
            self.core.apply(rank, &batch, received);
        }
    }

    /// Polls `engine` every `interval` until the task is aborted, one request at a time;
    /// signals `first` after the first answer.
    pub(crate) async fn run(
        mut self,
        engine: EngineClient,
        interval: Duration,
        first: oneshot::Sender<()>,
    ) {
        let mut first = Some(first);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match engine.post(PATH, POLL_TIMEOUT).await {
                Ok((status, body)) if status.is_success() => {
                    self.apply(&body, Instant::now());
                    if let Some(first) = first.take() {
                        tracing::info!("polling the engine's KV cache events");
                        let _ = first.send(());
                    }
                }
                Ok((status, _)) => {
                    tracing::debug!(%status, "the engine's /kv_cache_events answered an error");
                }
                Err(why) => tracing::debug!(%why, "cannot poll the engine's /kv_cache_events"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_control::InstanceId;
    use tokio::sync::mpsc;

    use super::*;

    /// An intake of 32-token blocks for `ranks` ranks, and the metrics it counts into.
    fn new_intake(
        ranks: u32,
    ) -> (
        TrtllmIntake,
        AgentMetrics,
        mpsc::Receiver<crate::core::Outgoing>,
    ) {
        let metrics = AgentMetrics::new().expect("metrics");
        let (tx, rx) = mpsc::channel(1024);
        let core = Core::new(InstanceId(1), ranks, 32, tx, metrics.clone()).expect("core");
        (
            TrtllmIntake::new(32, Arc::new(core), metrics.clone()),
            metrics,
            rx,
        )
    }

    fn fixture(name: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/trtllm")
            .join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn play(intake: &mut TrtllmIntake, names: &[&str]) {
        for name in names {
            intake.apply(&fixture(name), Instant::now());
        }
    }

    #[test]
    fn an_engine_lifetime_leaves_exactly_its_full_blocks() {
        let (mut intake, metrics, _out) = new_intake(1);
        metrics.events_complete.set(1);
        play(
            &mut intake,
            &[
                "single-01-created.json",
                "single-02-stored.json",
                "single-03-evicted.json",
                "single-04-empty.json",
                "single-05-restored.json",
            ],
        );
        assert_eq!(metrics.cached_blocks.get(), 6, "A0 A1 B1 C0 C1 D");
        assert_eq!(metrics.translation_misses.get(), 0);
        assert_eq!(
            metrics.dropped.with_label_values(&["partial_block"]).get(),
            2
        );
        play(&mut intake, &["single-06-restarted.json"]);
        assert_eq!(metrics.cached_blocks.get(), 1, "E, after the restart");
        assert_eq!(
            (metrics.engine_seq_gaps.get(), metrics.events_complete.get()),
            (0, 1)
        );
    }

    #[test]
    fn dropped_events_make_the_view_incomplete_until_a_restart() {
        let (mut intake, metrics, _out) = new_intake(1);
        metrics.events_complete.set(1);
        play(
            &mut intake,
            &["overflow-01-created.json", "overflow-02-dropped.json"],
        );
        assert_eq!(metrics.cached_blocks.get(), 2, "F2 F3");
        assert_eq!(
            (metrics.engine_seq_gaps.get(), metrics.events_complete.get()),
            (1, 0)
        );
        play(&mut intake, &["vswa-01.json"]);
        assert_eq!(
            (metrics.cached_blocks.get(), metrics.events_complete.get()),
            (2, 1),
            "I0 I1 of the restarted engine's largest window"
        );
        assert_eq!(metrics.dropped.with_label_values(&["kv_group"]).get(), 2);
    }

    #[test]
    fn attention_dp_ranks_go_to_their_tables_and_need_the_ranks() {
        let (mut intake, metrics, _out) = new_intake(2);
        play(&mut intake, &["adp-01.json"]);
        assert_eq!(
            metrics.cached_blocks.get(),
            3,
            "G0 G1 on rank 0, G0 on rank 1"
        );
        let (mut intake, metrics, _out) = new_intake(1);
        play(&mut intake, &["adp-01.json"]);
        assert_eq!(metrics.cached_blocks.get(), 2, "rank 1 has no table");
    }

    #[test]
    fn ids_going_back_without_a_created_are_a_restart_that_lost_events() {
        let (mut intake, metrics, _out) = new_intake(1);
        metrics.events_complete.set(1);
        play(
            &mut intake,
            &[
                "single-01-created.json",
                "single-02-stored.json",
                "single-03-evicted.json",
                "single-05-restored.json",
                "overflow-02-dropped.json",
            ],
        );
        assert_eq!(
            metrics.cached_blocks.get(),
            2,
            "F2 F3 of the new engine only"
        );
        assert_eq!(
            (metrics.engine_seq_gaps.get(), metrics.events_complete.get()),
            (1, 0)
        );
    }

    #[test]
    fn a_first_event_past_zero_or_an_unreadable_answer_loses_events() {
        let (mut intake, metrics, _out) = new_intake(1);
        metrics.events_complete.set(1);
        play(&mut intake, &["single-05-restored.json"]);
        assert_eq!(metrics.events_complete.get(), 0, "ids 0..6 were never seen");
        assert_eq!(
            metrics.translation_misses.get(),
            2,
            "under an unknown parent"
        );
        intake.apply(b"{\"not\": \"an array\"}", Instant::now());
        assert_eq!(metrics.malformed.get(), 1);
    }
}

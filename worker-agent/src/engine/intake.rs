//! Receiving one rank's KV event stream: a ZMQ SUB socket (reconnecting on its own), engine
//! sequence tracking, replay of missed batches, decoding, and translation into the core.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvmesh_engine_events::{EngineEvent, Layout, decode_batch};
use tokio::sync::{oneshot, watch};
use zeromq::{Socket, SocketRecv, SubSocket};

use super::replay;
use super::sequence::{SeqAction, SeqTracker};
use crate::core::Core;
use crate::metrics::AgentMetrics;

/// Pause after a receive error before trying again (the socket reconnects meanwhile).
const RECV_ERROR_PAUSE: Duration = Duration::from_millis(50);
/// Pause between attempts to connect to the engine's PUB socket.
const CONNECT_RETRY: Duration = Duration::from_millis(200);

/// One rank's stream.
pub(crate) struct Intake {
    /// The rank.
    pub rank: u32,
    /// Its PUB endpoint.
    pub endpoint: String,
    /// Its replay ROUTER endpoint, if any.
    pub replay_endpoint: Option<String>,
    /// Subscription prefix.
    pub topic: String,
    /// The engine's positional event layout.
    pub layout: Layout,
    /// Where translated batches go.
    pub core: Arc<Core>,
    /// Counters.
    pub metrics: AgentMetrics,
}

impl Intake {
    /// Decodes and applies one engine payload.
    fn process(&self, payload: &[u8], received: Instant) {
        match decode_batch(self.layout, payload) {
            Ok(batch) => {
                if let Some(why) = &batch.malformed_reason {
                    tracing::debug!(
                        rank = self.rank,
                        skipped = batch.malformed_events,
                        %why,
                        "skipping malformed KV events"
                    );
                }
                if let Some(rank) = batch.dp_rank
                    && rank != self.rank
                {
                    tracing::debug!(
                        socket_rank = self.rank,
                        batch_rank = rank,
                        "batch names another rank"
                    );
                }
                if batch
                    .events
                    .iter()
                    .any(|event| matches!(event, EngineEvent::Cleared))
                {
                    // The engine's cache is empty: nothing lost before counts any more.
                    self.metrics.events_complete.set(1);
                }
                self.core.apply(self.rank, &batch, received);
            }
            Err(why) => {
                self.metrics.malformed.inc();
                tracing::debug!(rank = self.rank, %why, "skipping a malformed KV event message");
            }
        }
    }

    /// Replays `from..until` from the engine and applies what comes back; records the last
    /// applied number in `tracker`.
    async fn replay(&self, tracker: &mut SeqTracker, from: u64, until: u64) {
        let Some(endpoint) = &self.replay_endpoint else {
            return;
        };
        let result = match replay::fetch(endpoint, from).await {
            Ok(batches) => {
                let mut expected = from;
                let mut complete = true;
                for (seq, payload) in batches {
                    if seq < expected || seq >= until {
                        continue;
                    }
                    complete &= seq == expected;
                    self.process(&payload, Instant::now());
                    tracker.applied(seq);
                    expected = seq + 1;
                }
                if complete && expected == until {
                    "ok"
                } else {
                    "incomplete"
                }
            }
            Err(why) => {
                tracing::warn!(rank = self.rank, %why, "KV event replay failed");
                "failed"
            }
        };
        if result != "ok" {
            tracing::warn!(rank = self.rank, from, until, result, "KV events were lost");
            self.metrics.events_complete.set(0);
        }
        self.metrics.replays.with_label_values(&[result]).inc();
    }

    /// At start, with a replay socket: applies what the engine's buffer holds (batches
    /// published before this agent subscribed, which no live message would bring) and
    /// records the last one in `tracker`. Counted `ok` when the buffer reaches back to the
    /// engine's first batch, `incomplete` when it does not (older batches are lost); an
    /// engine not answering yet (it starts after the agent) is not a failure.
    async fn replay_at_start(&self, tracker: &mut SeqTracker) {
        let Some(endpoint) = &self.replay_endpoint else {
            return;
        };
        let batches = match replay::fetch(endpoint, 0).await {
            Ok(batches) => batches,
            Err(why) => {
                tracing::debug!(rank = self.rank, %why, "no replay at start");
                return;
            }
        };
        let Some(&(first, _)) = batches.first() else {
            return;
        };
        self.apply_newer(tracker, batches);
        let result = if first == 0 { "ok" } else { "incomplete" };
        tracing::info!(
            rank = self.rank,
            first,
            last = tracker.last(),
            result,
            "started after the engine: replayed its buffer"
        );
        if first > 0 {
            tracing::warn!(
                rank = self.rank,
                from = 0,
                until = first,
                "KV events were lost"
            );
            self.metrics.events_complete.set(0);
        }
        self.metrics.replays.with_label_values(&[result]).inc();
    }

    /// Handles one live message `[topic, seq, payload]`.
    async fn on_message(&self, tracker: &mut SeqTracker, frames: &[Bytes], received: Instant) {
        let [_topic, seq, payload] = frames else {
            self.metrics.malformed.inc();
            return;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()) else {
            self.metrics.malformed.inc();
            return;
        };
        let seq = u64::from_be_bytes(seq);
        match tracker.check(seq) {
            SeqAction::Apply => {}
            SeqAction::Skip => return,
            SeqAction::Restart => {
                tracing::info!(
                    rank = self.rank,
                    "engine event sequence restarted: forgetting its blocks"
                );
                self.core.reset_rank(self.rank);
                // A new engine: what was lost of the old one's events no longer matters.
                self.metrics.events_complete.set(1);
            }
            SeqAction::CatchUp { from } => {
                if self.replay_endpoint.is_some() {
                    tracing::info!(
                        rank = self.rank,
                        first = seq,
                        "started after the engine: replaying its buffer"
                    );
                    self.replay(tracker, from, seq).await;
                }
            }
            SeqAction::Gap { from } => {
                self.metrics.engine_seq_gaps.inc();
                tracing::info!(rank = self.rank, from, to = seq, "gap in engine KV events");
                self.replay(tracker, from, seq).await;
            }
        }
        self.process(payload, received);
        tracker.applied(seq);
    }

    /// A SUB socket connected and subscribed to the engine's PUB endpoint (retried until it
    /// is); `None` when subscribing fails.
    async fn subscribe(&self) -> Option<SubSocket> {
        let mut socket = SubSocket::new();
        loop {
            match socket.connect(&self.endpoint).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::debug!(endpoint = %self.endpoint, error = %e, "engine KV event socket not reachable yet");
                    tokio::time::sleep(CONNECT_RETRY).await;
                }
            }
        }
        if let Err(e) = socket.subscribe(&self.topic).await {
            tracing::error!(error = %e, "cannot subscribe to engine KV events");
            return None;
        }
        tracing::info!(rank = self.rank, endpoint = %self.endpoint, "subscribed to engine KV events");
        Some(socket)
    }

    /// After the engine came back from unreachable: it may have restarted, with an empty
    /// cache and its numbers from 0 again (which live messages alone cannot tell once the
    /// new engine has published past the old last number). A replay buffer that does not
    /// reach the last applied number, or no replay socket to ask, means a new engine: its
    /// blocks are forgotten and numbering starts over. Otherwise what was missed is applied.
    async fn resume(&self, tracker: &mut SeqTracker) {
        let buffered = match &self.replay_endpoint {
            Some(endpoint) => replay::fetch(endpoint, 0).await.ok(),
            None => None,
        };
        let restarted = match (&buffered, tracker.last()) {
            (_, None) => false,
            (Some(batches), Some(last)) => batches.last().is_none_or(|&(seq, _)| seq < last),
            (None, Some(_)) => true,
        };
        if restarted {
            tracing::info!(
                rank = self.rank,
                "engine came back restarted: forgetting its blocks"
            );
            self.core.reset_rank(self.rank);
            *tracker = SeqTracker::default();
        }
        self.apply_newer(tracker, buffered.unwrap_or_default());
    }

    /// Applies the replayed `batches` numbered after the last one `tracker` applied.
    fn apply_newer(&self, tracker: &mut SeqTracker, batches: Vec<(u64, Bytes)>) {
        for (seq, payload) in batches {
            if tracker.last().is_none_or(|last| seq > last) {
                self.process(&payload, Instant::now());
                tracker.applied(seq);
            }
        }
    }

    /// Connects, signals `connected`, then runs until the task is aborted; reconnects each
    /// time `recovered` changes (the engine came back from unreachable).
    pub(crate) async fn run(
        self,
        connected: oneshot::Sender<()>,
        mut recovered: watch::Receiver<u64>,
    ) {
        let Some(mut socket) = self.subscribe().await else {
            return;
        };
        let mut tracker = SeqTracker::default();
        self.replay_at_start(&mut tracker).await;
        let _ = connected.send(());
        loop {
            let received = tokio::select! {
                received = socket.recv() => received,
                changed = recovered.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    drop(socket);
                    let Some(resubscribed) = self.subscribe().await else {
                        return;
                    };
                    socket = resubscribed;
                    self.resume(&mut tracker).await;
                    continue;
                }
            };
            match received {
                Ok(msg) => {
                    let received = Instant::now();
                    let frames = msg.into_vec();
                    self.on_message(&mut tracker, &frames, received).await;
                }
                Err(e) => {
                    tracing::debug!(rank = self.rank, error = %e, "KV event receive failed");
                    tokio::time::sleep(RECV_ERROR_PAUSE).await;
                }
            }
        }
    }
}

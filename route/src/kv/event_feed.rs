//! The overlap source of a `policy: kv` model whose engines publish KV events: a
//! [`KvIndex`] fed by the event intake (the proxy's control plane), with approximate mode as
//! the fallback while events do not flow.
//!
//! - **Events live** (the event bus is connected and the intake subscribed): lookups read the
//!   event-fed index, which holds what the engines report they cache.
//! - **Events down** (no bus yet, or the connection dropped): lookups read the predictions of
//!   approximate mode, exactly as without events. When events resume, the intake resyncs
//!   every instance from its agent's snapshot before switching back.
//!
//! Routing decisions are recorded as predictions in both states, so a fallback starts with
//! the recent decisions already predicted instead of an empty cache. While events flow, the
//! decisions of the last [`RECENT_TTL`] count beside them too (a side index): a request routed
//! before its engine's events arrive still draws its siblings to where its blocks are being
//! prefilled, as in approximate mode.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvmesh_kv::{
    ApplyOutcome, ApproxConfig, ApproxConfigError, BlockHashes, KvEvent, KvIndex, OverlapScores,
    SequenceHash, WorkerKey,
};

use crate::kv::overlap::{Approximate, OverlapSource};

/// How long a routing decision counts beside the event-fed index while events flow: long
/// enough for the engine to prefill and its events to arrive, short enough that blocks the
/// engine never stored (or evicted) stop counting soon.
pub const RECENT_TTL: Duration = Duration::from_secs(2);

/// The event-fed index of one model, the decisions of the last [`RECENT_TTL`] beside it,
/// and whether it is trusted now.
///
/// The intake changes the index only through [`EventFeed::apply`] and
/// [`EventFeed::clear_instance`], which drop an instance's recent decisions together with
/// its blocks: a cache the engine cleared shows no overlap at once.
#[derive(Debug)]
pub struct EventFeed {
    index: KvIndex,
    recent: Approximate,
    live: AtomicBool,
}

impl EventFeed {
    /// An empty feed whose recent decisions count for `recent_ttl`, bounded like approximate
    /// mode's predictions (`max_blocks`, `prune_target_ratio` of `limits`).
    pub fn new(recent_ttl: Duration, limits: ApproxConfig) -> Result<Self, ApproxConfigError> {
        Ok(Self {
            index: KvIndex::default(),
            recent: Approximate::new(ApproxConfig {
                ttl: recent_ttl,
                ..limits
            })?,
            live: AtomicBool::new(false),
        })
    }

    /// The index the intake applies events to (read-only uses: lookups, sizes).
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// Applies one of `worker`'s KV events; a cleared cache also drops the instance's recent
    /// decisions.
    pub fn apply(&self, worker: WorkerKey, event: &KvEvent) -> ApplyOutcome {
        if matches!(event, KvEvent::Cleared) {
            self.recent.remove_instance(worker.instance_id);
        }
        self.index.apply(worker, event)
    }

    /// Forgets everything instance `instance` caches: its blocks and its recent decisions
    /// (a resync from a snapshot, or the instance left).
    pub fn clear_instance(&self, instance: u64) {
        self.index.remove_worker(instance);
        self.recent.remove_instance(instance);
    }

    /// Whether lookups read the event-fed index (else the predictions).
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Switches lookups to the event-fed index (`true`) or to the predictions.
    pub fn set_live(&self, live: bool) {
        self.live.store(live, Ordering::Release);
    }
}

/// Overlaps from the event-fed index (with the recent decisions) while events flow, else
/// from predictions.
#[derive(Debug)]
pub(crate) struct EventFed {
    feed: Arc<EventFeed>,
    predicted: Approximate,
}

impl EventFed {
    /// A source reading `feed` when live and `predicted` otherwise.
    pub(crate) fn new(feed: Arc<EventFeed>, predicted: Approximate) -> Self {
        Self { feed, predicted }
    }
}

impl OverlapSource for EventFed {
    fn find_matches(&self, query: &[SequenceHash], now: Instant) -> OverlapScores {
        if self.feed.is_live() {
            let reported = self.feed.index.find_matches(query);
            reported.merge(self.feed.recent.find_matches(query, now))
        } else {
            self.predicted.find_matches(query, now)
        }
    }

    fn record(&self, worker: WorkerKey, blocks: &BlockHashes, now: Instant) -> u64 {
        self.feed.recent.record(worker, blocks, now);
        self.predicted.record(worker, blocks, now)
    }

    fn expire(&self, now: Instant) {
        self.predicted.expire(now);
        self.feed.recent.expire(now);
    }

    fn cached_blocks(&self) -> Vec<(WorkerKey, u64)> {
        if self.feed.is_live() {
            self.feed.index.cached_blocks()
        } else {
            self.predicted.cached_blocks()
        }
    }

    fn remove_instance(&self, instance: u64) {
        self.feed.clear_instance(instance);
        self.predicted.remove_instance(instance);
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_kv::{BlockHasher, ExternalHash};

    use super::*;

    fn source() -> (Arc<EventFeed>, EventFed) {
        let feed = Arc::new(EventFeed::new(RECENT_TTL, ApproxConfig::default()).unwrap());
        let predicted = Approximate::new(ApproxConfig::default()).unwrap();
        (Arc::clone(&feed), EventFed::new(feed, predicted))
    }

    #[test]
    fn lookups_follow_events_while_live_and_predictions_otherwise() {
        let (feed, source) = source();
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let prompt = hasher.hash(&(0..16).collect::<Vec<u32>>());
        let now = Instant::now();
        source.record(WorkerKey::new(1, 0), &prompt, now);
        let event = KvEvent::stored(
            None,
            prompt
                .local
                .iter()
                .take(2)
                .enumerate()
                .map(|(i, &local)| (ExternalHash(i as u64), local)),
        );
        feed.apply(WorkerKey::new(2, 0), &event);
        let predicted = source.find_matches(&prompt.sequence, now);
        assert_eq!(predicted.depth(WorkerKey::new(1, 0)), 4);
        assert_eq!(predicted.depth(WorkerKey::new(2, 0)), 0);
        feed.set_live(true);
        // Just routed: the decision counts beside the events until its events can arrive.
        let fresh = source.find_matches(&prompt.sequence, now);
        assert_eq!(fresh.depth(WorkerKey::new(1, 0)), 4);
        assert_eq!(fresh.depth(WorkerKey::new(2, 0)), 2);
        let later = now + RECENT_TTL + Duration::from_millis(1);
        let reported = source.find_matches(&prompt.sequence, later);
        assert_eq!(reported.depth(WorkerKey::new(1, 0)), 0);
        assert_eq!(reported.depth(WorkerKey::new(2, 0)), 2);
        assert_eq!(source.cached_blocks(), [(WorkerKey::new(2, 0), 2)]);
        source.remove_instance(2);
        assert!(source.find_matches(&prompt.sequence, later).is_empty());
        source.remove_instance(1);
        assert!(source.find_matches(&prompt.sequence, now).is_empty());
    }

    #[test]
    fn a_cleared_or_resynced_cache_drops_the_recent_decisions_too() {
        let (feed, source) = source();
        feed.set_live(true);
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let prompt = hasher.hash(&(0..16).collect::<Vec<u32>>());
        let now = Instant::now();
        for instance in [1, 2] {
            source.record(WorkerKey::new(instance, 0), &prompt, now);
        }
        let both = source.find_matches(&prompt.sequence, now);
        assert_eq!(both.depth(WorkerKey::new(1, 0)), 4);
        assert_eq!(both.depth(WorkerKey::new(2, 0)), 4);
        feed.apply(WorkerKey::new(1, 0), &KvEvent::Cleared);
        feed.clear_instance(2);
        assert!(source.find_matches(&prompt.sequence, now).is_empty());
        // The predictions for a fallback keep them.
        feed.set_live(false);
        let predicted = source.find_matches(&prompt.sequence, now);
        assert_eq!(predicted.depth(WorkerKey::new(1, 0)), 4);
        assert_eq!(predicted.depth(WorkerKey::new(2, 0)), 4);
    }
}

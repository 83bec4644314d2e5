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
//! the recent decisions already predicted instead of an empty cache.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvmesh_kv::{BlockHashes, KvIndex, OverlapScores, SequenceHash, WorkerKey};

use crate::kv::overlap::{Approximate, OverlapSource};

/// The event-fed index of one model and whether it is trusted now.
#[derive(Debug, Default)]
pub struct EventFeed {
    index: KvIndex,
    live: AtomicBool,
}

impl EventFeed {
    /// The index the intake applies events to.
    pub fn index(&self) -> &KvIndex {
        &self.index
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

/// Overlaps from the event-fed index while events flow, else from predictions.
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
            self.feed.index.find_matches(query)
        } else {
            self.predicted.find_matches(query, now)
        }
    }

    fn record(&self, worker: WorkerKey, blocks: &BlockHashes, now: Instant) -> u64 {
        self.predicted.record(worker, blocks, now)
    }

    fn expire(&self, now: Instant) {
        self.predicted.expire(now);
    }

    fn cached_blocks(&self) -> Vec<(WorkerKey, u64)> {
        if self.feed.is_live() {
            self.feed.index.cached_blocks()
        } else {
            self.predicted.cached_blocks()
        }
    }

    fn remove_instance(&self, instance: u64) {
        self.feed.index.remove_worker(instance);
        self.predicted.remove_instance(instance);
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_kv::{ApproxConfig, BlockHasher, ExternalHash, KvEvent};

    use super::*;

    #[test]
    fn lookups_follow_events_while_live_and_predictions_otherwise() {
        let feed = Arc::new(EventFeed::default());
        let source = EventFed::new(
            Arc::clone(&feed),
            Approximate::new(ApproxConfig::default()).unwrap(),
        );
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
        feed.index().apply(WorkerKey::new(2, 0), &event);
        let predicted = source.find_matches(&prompt.sequence, now);
        assert_eq!(predicted.depth(WorkerKey::new(1, 0)), 4);
        assert_eq!(predicted.depth(WorkerKey::new(2, 0)), 0);
        feed.set_live(true);
        let reported = source.find_matches(&prompt.sequence, now);
        assert_eq!(reported.depth(WorkerKey::new(1, 0)), 0);
        assert_eq!(reported.depth(WorkerKey::new(2, 0)), 2);
        assert_eq!(source.cached_blocks(), [(WorkerKey::new(2, 0), 2)]);
        source.remove_instance(2);
        assert!(source.find_matches(&prompt.sequence, now).is_empty());
    }
}

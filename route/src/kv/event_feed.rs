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
//! Routing decisions are recorded as predictions in both states (approximate mode's index,
//! `kv.approx_ttl`). While events flow they count beside the reported blocks (a side index):
//! a request routed before its engine's events arrive still draws its siblings to where its
//! blocks are being prefilled, and a conversation keeps going where it was sent even after
//! its engine evicted part of it, instead of spreading copies of its prefix over the fleet.
//! Keeping them for `approx_ttl` (120 s) instead of 2 s cut the conversation trace's TTFT p50
//! by 7 % and raised its reuse, chat unchanged within noise (docs/configuration.md, *The
//! defaults*). A fallback starts with them already predicted instead of an empty cache.
//!
//! The feed also checks itself against the engines' answers ([`crate::kv::cache_check`]): an
//! instance whose answers keep disagreeing with the index is *untrusted* (scored by its
//! predictions alone, its events still applied) and a resync of it is asked for
//! ([`EventFeed::resync_requests_to`]) until its snapshot makes it trusted again.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use arc_swap::ArcSwap;
use kvmesh_config::KvCacheCheckConfig;
use tokio::sync::mpsc;

use kvmesh_kv::{
    ApplyOutcome, ApproxConfig, ApproxConfigError, BlockHashes, DetachedWorker, IndexLimits,
    KvEvent, KvIndex, OverlapScores, SequenceHash, WorkerKey,
};

use crate::kv::cache_check::{CacheCheck, CacheCheckState, Expectation, Verdict};
use crate::kv::overlap::{Approximate, OverlapSource};

/// The event-fed index of one model, its routing decisions beside it, and whether the index
/// is trusted now.
///
/// The intake changes the index only through [`EventFeed::apply`] and
/// [`EventFeed::clear_instance`], which drop an instance's predicted blocks together with its
/// reported ones: a cache the engine cleared shows no overlap at once.
#[derive(Debug)]
pub struct EventFeed {
    index: KvIndex,
    predicted: Approximate,
    live: AtomicBool,
    /// Instances whose events are not indexed (their engine's block size differs from the
    /// model's, so their hashes could never match): they are scored by predictions alone.
    approximate_only: ArcSwap<HashSet<u64>>,
    /// Instances whose answers disagreed with the index too often: scored by predictions
    /// alone until a resync answers (their events are still indexed).
    untrusted: ArcSwap<HashSet<u64>>,
    /// Instances whose agent lost KV events its engine could not replay (its load reports
    /// say so): scored by predictions alone until its view is whole again.
    incomplete: ArcSwap<HashSet<u64>>,
    /// The answers judged against the index.
    check: CacheCheck,
    /// Where an untrusted instance's resync is asked for (the intake).
    resyncs: Mutex<Option<mpsc::UnboundedSender<u64>>>,
}

impl EventFeed {
    /// An empty feed whose index holds at most `index_max_blocks` (instance, block) pairs
    /// (`None`: no bound), whose decisions are predicted as approximate mode's are (`limits`),
    /// checked against the engines' answers as `check` says.
    pub fn new(
        index_max_blocks: Option<u64>,
        limits: ApproxConfig,
        check: &KvCacheCheckConfig,
    ) -> Result<Self, ApproxConfigError> {
        Ok(Self {
            index: KvIndex::with_limits(IndexLimits {
                max_blocks: index_max_blocks.filter(|&max| max > 0),
            }),
            predicted: Approximate::new(limits)?,
            live: AtomicBool::new(false),
            approximate_only: ArcSwap::from_pointee(HashSet::new()),
            untrusted: ArcSwap::from_pointee(HashSet::new()),
            incomplete: ArcSwap::from_pointee(HashSet::new()),
            check: CacheCheck::new(check),
            resyncs: Mutex::new(None),
        })
    }

    /// Instance `instance`'s engine holds `blocks` KV blocks (in the model's block size) on its
    /// device, over `dp_ranks` data-parallel ranks, each with an equal share: past the
    /// index's bound, a rank holding more than its share loses blocks first (a lagging or
    /// misreporting engine). Nothing changes without a bound or with `blocks` 0 (unknown).
    pub fn set_capacity(&self, instance: u64, blocks: u64, dp_ranks: u32) {
        if self.index.limits().max_blocks.is_none() || blocks == 0 {
            return;
        }
        let ranks = dp_ranks.max(1);
        let share = blocks.div_ceil(u64::from(ranks));
        for rank in 0..ranks {
            self.index
                .set_worker_capacity(WorkerKey::new(instance, rank), share);
        }
    }

    /// From now on, the id of every instance that becomes untrusted goes to `requests`, whose
    /// receiver resyncs it and then calls [`Self::trust`].
    pub fn resync_requests_to(&self, requests: mpsc::UnboundedSender<u64>) {
        *self.resyncs.lock().unwrap_or_else(PoisonError::into_inner) = Some(requests);
    }

    /// Instance `instance` was resynced from its agent's snapshot: its overlap is read from
    /// the index again, and its check starts over.
    pub fn trust(&self, instance: u64) {
        self.check.trusted(instance);
        toggle(&self.untrusted, instance, false);
    }

    /// Whether instance `instance` is scored by its predictions alone because its answers
    /// disagreed with the index (until its resync answers).
    pub fn is_untrusted(&self, instance: u64) -> bool {
        let untrusted = self.untrusted.load();
        !untrusted.is_empty() && untrusted.contains(&instance)
    }

    /// Instance `instance`'s agent says its view of the engine's cache is not whole (`true`:
    /// it lost KV events its engine could not replay) or is again; while not whole, the
    /// instance is scored by its predictions alone. Returns whether that changed.
    pub fn set_events_incomplete(&self, instance: u64, incomplete: bool) -> bool {
        toggle(&self.incomplete, instance, incomplete)
    }

    /// Whether instance `instance`'s agent lost KV events its engine could not replay
    /// ([`Self::set_events_incomplete`]).
    pub fn is_events_incomplete(&self, instance: u64) -> bool {
        let incomplete = self.incomplete.load();
        !incomplete.is_empty() && incomplete.contains(&instance)
    }

    /// Whether answers are judged against the index now: the check is on and events flow.
    pub(crate) fn checks(&self) -> bool {
        self.check.is_on() && self.is_live()
    }

    /// Judges an answer of instance `instance` that reported `actual` blocks cached against
    /// what its routing decision `expected`; past the check's threshold the instance is
    /// untrusted and its resync asked for. `None`: not judged (the instance is untrusted).
    pub(crate) fn judge(
        &self,
        instance: u64,
        expected: &Expectation,
        actual: u32,
    ) -> Option<Verdict> {
        let verdict = self.check.judge(instance, expected, actual)?;
        if verdict == Verdict::Tripped {
            toggle(&self.untrusted, instance, true);
            let resyncs = self.resyncs.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(resyncs) = resyncs.as_ref() {
                let _ = resyncs.send(instance);
            }
        }
        Some(verdict)
    }

    /// Counts an answer of instance `instance` with usage but no `cached_tokens`; returns
    /// whether it was the instance's first.
    pub(crate) fn without_cached_tokens(&self, instance: u64) -> bool {
        self.check.without_details(instance)
    }

    /// Instance `instance`'s check, for `/debug/route` (`None`: off or nothing counted).
    pub(crate) fn check_state(&self, instance: u64) -> Option<CacheCheckState> {
        self.check.state(instance)
    }

    /// Forgets instance `instance`'s check and trust (it left the pool).
    pub(crate) fn forget_check(&self, instance: u64) {
        self.check.forget(instance);
        toggle(&self.untrusted, instance, false);
        toggle(&self.incomplete, instance, false);
    }

    /// The index the intake applies events to (read-only uses: lookups, sizes).
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// Applies one of `worker`'s KV events; a cleared cache also drops the instance's
    /// predicted blocks. The events of an instance that is
    /// [approximate only](Self::is_approximate_only) are not indexed (an empty outcome).
    pub fn apply(&self, worker: WorkerKey, event: &KvEvent) -> ApplyOutcome {
        if self.is_approximate_only(worker.instance_id) {
            return ApplyOutcome::default();
        }
        if matches!(event, KvEvent::Cleared) {
            self.predicted.remove_instance(worker.instance_id);
        }
        self.index.apply(worker, event)
    }

    /// Forgets everything instance `instance` caches: its reported and its predicted blocks
    /// (a resync from a snapshot, or the instance left).
    pub fn clear_instance(&self, instance: u64) {
        let detached = self.detach_instance(instance);
        self.release_detached(detached);
    }

    /// [`clear_instance`](Self::clear_instance) but for freeing the reported blocks: lookups
    /// and its events no longer see them from now on, and
    /// [`release_detached`](Self::release_detached) frees them, a scan of the whole index
    /// (about 5 ms per million blocks) for a caller to run off the async runtime.
    pub fn detach_instance(&self, instance: u64) -> DetachedWorker {
        let detached = self.index.detach_worker(instance);
        self.predicted.remove_instance(instance);
        detached
    }

    /// Frees the blocks of an instance [`detach_instance`](Self::detach_instance) took out.
    pub fn release_detached(&self, detached: DetachedWorker) {
        self.index.release_detached(detached);
    }

    /// From now on instance `instance`'s events are not indexed (`true`; what the index held
    /// of it is dropped) or are again (`false`): while its engine's block size differs from
    /// the model's, its hashes could never match, and it is scored by predictions alone.
    pub fn set_approximate_only(&self, instance: u64, on: bool) {
        if toggle(&self.approximate_only, instance, on) && on {
            self.index.remove_worker(instance);
        }
    }

    /// Whether instance `instance`'s events are left out of the index
    /// ([`Self::set_approximate_only`]).
    pub fn is_approximate_only(&self, instance: u64) -> bool {
        let excluded = self.approximate_only.load();
        !excluded.is_empty() && excluded.contains(&instance)
    }

    /// Whether lookups read the event-fed index beside the predictions (else the predictions
    /// alone).
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Switches lookups to the event-fed index (`true`) or to the predictions alone.
    pub fn set_live(&self, live: bool) {
        self.live.store(live, Ordering::Release);
    }
}

/// Puts `instance` into `set` (`on`) or takes it out; returns whether that changed the set.
fn toggle(set: &ArcSwap<HashSet<u64>>, instance: u64, on: bool) -> bool {
    if set.load().contains(&instance) == on {
        return false;
    }
    set.rcu(|current| {
        let mut next = HashSet::clone(current);
        if on {
            next.insert(instance);
        } else {
            next.remove(&instance);
        }
        next
    });
    true
}

/// Overlaps from the event-fed index and the predictions while events flow, else from the
/// predictions alone.
#[derive(Debug)]
pub(crate) struct EventFed {
    feed: Arc<EventFeed>,
}

impl EventFed {
    /// A source reading `feed`.
    pub(crate) fn new(feed: Arc<EventFeed>) -> Self {
        Self { feed }
    }
}

impl OverlapSource for EventFed {
    fn find_matches(&self, query: &[SequenceHash], now: Instant) -> OverlapScores {
        self.find_matches_reported(query, now).0
    }

    fn find_matches_reported(
        &self,
        query: &[SequenceHash],
        now: Instant,
    ) -> (OverlapScores, Option<OverlapScores>) {
        let predicted = self.feed.predicted.find_matches(query, now);
        if self.feed.is_live() {
            let mut reported = self.feed.index.find_matches(query);
            let (untrusted, incomplete) = (self.feed.untrusted.load(), self.feed.incomplete.load());
            if !untrusted.is_empty() || !incomplete.is_empty() {
                reported.workers.retain(|overlap| {
                    let instance = overlap.worker.instance_id;
                    !untrusted.contains(&instance) && !incomplete.contains(&instance)
                });
            }
            (reported.clone().merge(predicted), Some(reported))
        } else {
            (predicted, None)
        }
    }

    fn record_blocks(
        &self,
        worker: WorkerKey,
        blocks: &BlockHashes,
        range: Range<usize>,
        now: Instant,
    ) -> u64 {
        self.feed
            .predicted
            .record_blocks(worker, blocks, range, now)
    }

    fn expire(&self, now: Instant) {
        self.feed.predicted.expire(now);
    }

    fn cached_blocks(&self) -> Vec<(WorkerKey, u64)> {
        if self.feed.is_live() {
            self.feed.index.cached_blocks()
        } else {
            self.feed.predicted.cached_blocks()
        }
    }

    fn remove_instance(&self, instance: u64) {
        self.feed.clear_instance(instance);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kvmesh_kv::{BlockHasher, ExternalHash};

    use super::*;

    const TTL: Duration = Duration::from_secs(120);

    fn source() -> (Arc<EventFeed>, EventFed) {
        let limits = ApproxConfig {
            ttl: TTL,
            ..ApproxConfig::default()
        };
        let feed = Arc::new(EventFeed::new(None, limits, &KvCacheCheckConfig::default()).unwrap());
        (Arc::clone(&feed), EventFed::new(feed))
    }

    #[test]
    fn lookups_follow_events_beside_predictions_while_live_and_predictions_otherwise() {
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
        assert_eq!(source.cached_blocks(), [(WorkerKey::new(1, 0), 4)]);
        feed.set_live(true);
        // The decision counts beside the events, until long after its events could arrive.
        let fresh = source.find_matches(&prompt.sequence, now);
        assert_eq!(fresh.depth(WorkerKey::new(1, 0)), 4);
        assert_eq!(fresh.depth(WorkerKey::new(2, 0)), 2);
        let before_expiry = now + TTL - Duration::from_millis(1);
        let kept = source.find_matches(&prompt.sequence, before_expiry);
        assert_eq!(kept.depth(WorkerKey::new(1, 0)), 4);
        let later = now + TTL + Duration::from_millis(1);
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
    fn a_bounded_index_evicts_past_its_bound() {
        let feed = EventFeed::new(
            Some(4),
            ApproxConfig::default(),
            &KvCacheCheckConfig::default(),
        )
        .unwrap();
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let prompt = hasher.hash(&(0..24).collect::<Vec<u32>>());
        let blocks = |ids: std::ops::Range<u64>| {
            KvEvent::stored(
                None,
                ids.map(|i| (ExternalHash(i), prompt.local[i as usize])),
            )
        };
        // Two chains of three blocks (the second starts at block 3, an orphan chain) for
        // one instance: six pairs against a bound of four.
        feed.apply(WorkerKey::new(1, 0), &blocks(0..3));
        assert_eq!(feed.index().stats().evicted_blocks, 0);
        feed.apply(WorkerKey::new(1, 0), &blocks(3..6));
        let stats = feed.index().stats();
        assert_eq!(stats.evicted_blocks, 2);
        assert_eq!(stats.worker_blocks, 4);
        let unbounded = EventFeed::new(
            None,
            ApproxConfig::default(),
            &KvCacheCheckConfig::default(),
        )
        .unwrap();
        unbounded.apply(WorkerKey::new(1, 0), &blocks(0..3));
        unbounded.apply(WorkerKey::new(1, 0), &blocks(3..6));
        assert_eq!(unbounded.index().stats().worker_blocks, 6);
    }

    #[test]
    fn past_its_bound_the_index_evicts_first_from_a_rank_over_its_share() {
        let bounded = |max| {
            EventFeed::new(
                Some(max),
                ApproxConfig::default(),
                &KvCacheCheckConfig::default(),
            )
            .unwrap()
        };
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let prompts: Vec<_> = (0..3u32)
            .map(|p| hasher.hash(&(p * 100..p * 100 + 12).collect::<Vec<u32>>()))
            .collect();
        let stored = |p: usize, blocks: std::ops::Range<usize>| {
            KvEvent::stored(
                None,
                blocks.map(|b| (ExternalHash((p * 100 + b) as u64), prompts[p].local[b])),
            )
        };
        let run = |feed: &EventFeed| {
            // Instance 2 stores first (least recently used), instance 1 next: three blocks
            // each; instance 3's two more pass the bound of six by two.
            feed.apply(WorkerKey::new(2, 0), &stored(1, 0..3));
            feed.apply(WorkerKey::new(1, 0), &stored(0, 0..3));
            feed.apply(WorkerKey::new(3, 0), &stored(2, 0..2));
            assert_eq!(feed.index().stats().evicted_blocks, 2);
            let depth = |p: usize, instance: u64| {
                feed.index()
                    .find_matches(&prompts[p].sequence)
                    .depth(WorkerKey::new(instance, 0))
            };
            (depth(0, 1), depth(1, 2), depth(2, 3))
        };
        // Without capacities the least recently used instance loses its deepest blocks.
        assert_eq!(run(&bounded(6)), (3, 1, 2));
        // Instance 1 reports one block per rank over two ranks: rank 0 holds two too many.
        let feed = bounded(6);
        feed.set_capacity(1, 2, 2);
        assert_eq!(run(&feed), (1, 3, 2));
        // Without a bound a capacity registers nothing.
        let unbounded = EventFeed::new(
            None,
            ApproxConfig::default(),
            &KvCacheCheckConfig::default(),
        )
        .unwrap();
        unbounded.set_capacity(1, 2, 2);
        assert_eq!(unbounded.index().stats().workers, 0);
    }

    #[test]
    fn a_cleared_or_resynced_cache_drops_the_predictions_too() {
        let (feed, source) = source();
        feed.set_live(true);
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let prompt = hasher.hash(&(0..16).collect::<Vec<u32>>());
        let now = Instant::now();
        for instance in [1, 2, 3] {
            source.record(WorkerKey::new(instance, 0), &prompt, now);
        }
        let all = source.find_matches(&prompt.sequence, now);
        for instance in [1, 2, 3] {
            assert_eq!(all.depth(WorkerKey::new(instance, 0)), 4);
        }
        feed.apply(WorkerKey::new(1, 0), &KvEvent::Cleared);
        feed.clear_instance(2);
        let left = source.find_matches(&prompt.sequence, now);
        assert_eq!(left.depth(WorkerKey::new(1, 0)), 0);
        assert_eq!(left.depth(WorkerKey::new(2, 0)), 0);
        assert_eq!(left.depth(WorkerKey::new(3, 0)), 4);
        // A fallback predicts nothing there either: the engine said its cache is empty.
        feed.set_live(false);
        let predicted = source.find_matches(&prompt.sequence, now);
        assert_eq!(predicted.depth(WorkerKey::new(1, 0)), 0);
        assert_eq!(predicted.depth(WorkerKey::new(2, 0)), 0);
        assert_eq!(predicted.depth(WorkerKey::new(3, 0)), 4);
    }

    #[test]
    fn an_approximate_only_instance_is_scored_by_its_predictions_alone() {
        let (feed, source) = source();
        feed.set_live(true);
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let prompt = hasher.hash(&(0..16).collect::<Vec<u32>>());
        let stored = KvEvent::stored(
            None,
            prompt
                .local
                .iter()
                .enumerate()
                .map(|(i, &local)| (ExternalHash(i as u64), local)),
        );
        let now = Instant::now();
        feed.apply(WorkerKey::new(1, 0), &stored);
        feed.apply(WorkerKey::new(2, 0), &stored);
        feed.set_approximate_only(2, true);
        assert!(feed.is_approximate_only(2) && !feed.is_approximate_only(1));
        // What the index held of it is gone, and its events are not indexed any more.
        assert_eq!(
            feed.apply(WorkerKey::new(2, 0), &stored),
            ApplyOutcome::default()
        );
        let scores = source.find_matches(&prompt.sequence, now);
        assert_eq!(scores.depth(WorkerKey::new(1, 0)), 4);
        assert_eq!(scores.depth(WorkerKey::new(2, 0)), 0);
        // Its routing decisions still predict its cache.
        source.record(WorkerKey::new(2, 0), &prompt, now);
        let scores = source.find_matches(&prompt.sequence, now);
        assert_eq!(scores.depth(WorkerKey::new(2, 0)), 4);
        feed.set_approximate_only(2, false);
        assert!(!feed.is_approximate_only(2));
        feed.apply(WorkerKey::new(2, 0), &stored);
        assert_eq!(source.cached_blocks().len(), 2);
    }
}

//! Per-instance sequence tracking of KV event batches: what to apply, what to drop, when to
//! resync (docs/control-plane.md, "NATS: resync"). Pure state, no I/O: the intake executes
//! the [`Step`]s and sends the requests.
//!
//! An agent numbers its batches 1, 2, 3, … per instance (across its data-parallel ranks). For
//! each instance the tracker keeps the last applied number (the cursor):
//!
//! - **First sight** (no cursor: the proxy started late, or the instance just joined): the
//!   batch is buffered and a full snapshot is requested.
//! - **In order** (`seq == cursor + 1`): applied.
//! - **Stale** (`seq <= cursor`): dropped (a duplicate, or already covered by a snapshot).
//! - **Gap** (`seq > cursor + 1`): counted, buffered, and the missing batches are requested
//!   (`{"from_seq": cursor + 1}`); the agent answers with them, or with a snapshot when they
//!   left its ring buffer.
//!
//! While a resync is in flight, live batches are **buffered** (up to [`MAX_BUFFERED`] per
//! instance) and applied in order once the reply is in; a buffer that overflows is dropped
//! and the instance is resynced again after the reply (drop-and-redo). A buffered batch
//! numbered past the reply's `last_seq` that does not continue the cursor is **ahead of
//! its agent**: the agent publishes its batches before it answers, on one connection, so it
//! cannot be the agent's (a batch published for a real instance id by someone else). It is
//! dropped instead of asked for again, which would loop; if it was real after all, the next
//! batch shows the gap again. A snapshot reply
//! first drops every block of the instance, then applies its events; an events reply must
//! continue the cursor exactly, else a snapshot is requested instead.

use std::collections::{BTreeMap, HashMap};

use kvmesh_control::{EventBatch, RankedEvent, ReplyPart, SnapshotReply, SnapshotRequest};

/// Live batches kept per instance while its resync is in flight.
pub(crate) const MAX_BUFFERED: usize = 4096;

/// Why an instance is resynchronised (the `reason` label of `kvmesh_kv_resyncs_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ResyncReason {
    /// The first batch seen from the instance.
    FirstSight,
    /// Batches were missed.
    Gap,
    /// The event bus connection came back (or events started).
    Reconnect,
    /// Live batches overflowed the buffer during a resync.
    Overflow,
    /// The index reported blocks it could not place (unknown parent, invalid chain).
    Repair,
    /// A resync request failed, timed out or got an unreadable answer, and is sent again.
    Retry,
    /// The engine's answers' `cached_tokens` kept disagreeing with the index
    /// (`kv.cache_check`).
    CacheCheck,
}

impl ResyncReason {
    /// Every reason, for metric handles.
    pub(crate) const ALL: [Self; 7] = [
        Self::FirstSight,
        Self::Gap,
        Self::Reconnect,
        Self::Overflow,
        Self::Repair,
        Self::Retry,
        Self::CacheCheck,
    ];

    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::FirstSight => "first_sight",
            Self::Gap => "gap",
            Self::Reconnect => "reconnect",
            Self::Overflow => "overflow",
            Self::Repair => "repair",
            Self::Retry => "retry",
            Self::CacheCheck => "cache_check",
        }
    }
}

/// Something the intake must do to the index, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Drop every block of the instance (a snapshot's events follow).
    Clear,
    /// Apply one event of a snapshot.
    Snapshot(RankedEvent),
    /// Apply a batch.
    Batch(EventBatch),
}

/// What one input led to.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Outcome {
    /// Changes to apply, in order.
    pub(crate) steps: Vec<Step>,
    /// A resync to request (at most one in flight per instance).
    pub(crate) request: Option<(SnapshotRequest, ResyncReason)>,
    /// Batches dropped as stale.
    pub(crate) stale: u64,
    /// Gaps detected.
    pub(crate) gaps: u64,
    /// Batches dropped as ahead of their agent.
    pub(crate) ahead: u64,
}

/// One instance's position in its agent's batch sequence.
#[derive(Debug, Default)]
struct Cursor {
    /// The last batch number applied (`None`: never synced).
    last: Option<u64>,
    /// Whether a resync request is in flight.
    resyncing: bool,
    /// Live batches received during the resync, by number.
    buffer: BTreeMap<u64, EventBatch>,
    /// The buffer overflowed: resync again once the current reply is applied.
    overflowed: bool,
    /// The last batch number the agent's previous load report said it had numbered.
    reported: Option<u64>,
}

/// The cursors of every instance whose batches arrive.
#[derive(Debug, Default)]
pub(crate) struct SequenceTracker {
    cursors: HashMap<u64, Cursor>,
}

impl SequenceTracker {
    /// Takes one live batch.
    pub(crate) fn on_batch(&mut self, batch: EventBatch) -> Outcome {
        let cursor = self.cursors.entry(batch.instance_id.0).or_default();
        let mut outcome = Outcome::default();
        if cursor.resyncing {
            buffer(cursor, batch);
            return outcome;
        }
        match cursor.last {
            None => {
                buffer(cursor, batch);
                cursor.resyncing = true;
                outcome.request = Some((SnapshotRequest::full(), ResyncReason::FirstSight));
            }
            Some(last) if batch.seq <= last => outcome.stale = 1,
            Some(last) if batch.seq == last + 1 => {
                cursor.last = Some(batch.seq);
                outcome.steps.push(Step::Batch(batch));
            }
            Some(last) => {
                outcome.gaps = 1;
                buffer(cursor, batch);
                cursor.resyncing = true;
                outcome.request = Some((SnapshotRequest::from_seq(last + 1), ResyncReason::Gap));
            }
        }
        outcome
    }

    /// Takes one part of the answer to instance `instance`'s resync request, as it arrives
    /// (parts come in order; a reply that fits one message is part 0 of 1). A snapshot clears
    /// the instance at its first part and applies each part's events; a replay applies each
    /// part's batches that continue the cursor. The instance stays resyncing, its live
    /// batches buffered, until the last part is in.
    pub(crate) fn on_reply(&mut self, instance: u64, part: ReplyPart) -> Outcome {
        let mut outcome = Outcome::default();
        let Some(cursor) = self.cursors.get_mut(&instance) else {
            return outcome;
        };
        let complete = part.is_last();
        let newest = part.reply.last_seq();
        match part.reply {
            SnapshotReply::Snapshot { events, last_seq } => {
                if part.index == 0 {
                    outcome.steps.push(Step::Clear);
                }
                outcome.steps.extend(events.into_iter().map(Step::Snapshot));
                if complete {
                    cursor.last = Some(last_seq);
                }
            }
            SnapshotReply::Events { batches, last_seq } => {
                let Some(mut last) = cursor.last else {
                    // Replays continue a cursor; without one only a snapshot will do.
                    outcome.request = Some((SnapshotRequest::full(), ResyncReason::Gap));
                    return outcome;
                };
                for batch in batches {
                    if batch.seq <= last {
                        continue;
                    }
                    if batch.seq != last + 1 {
                        cursor.last = Some(last);
                        outcome.request = Some((SnapshotRequest::full(), ResyncReason::Gap));
                        return outcome;
                    }
                    last = batch.seq;
                    outcome.steps.push(Step::Batch(batch));
                }
                cursor.last = Some(last);
                if complete && last < last_seq {
                    // The reply promised batches it did not contain.
                    outcome.request =
                        Some((SnapshotRequest::from_seq(last + 1), ResyncReason::Gap));
                    return outcome;
                }
            }
        }
        if !complete {
            return outcome;
        }
        cursor.resyncing = false;
        if std::mem::take(&mut cursor.overflowed) {
            cursor.buffer.clear();
            cursor.resyncing = true;
            let from = cursor.last.map_or(1, |last| last + 1);
            outcome.request = Some((SnapshotRequest::from_seq(from), ResyncReason::Overflow));
            return outcome;
        }
        drain(cursor, &mut outcome, newest);
        outcome
    }

    /// Starts a full resync of `instance` (first sight by discovery, repair, or after a
    /// reconnect), superseding any resync in flight: live batches are buffered until
    /// [`SequenceTracker::on_reply`].
    pub(crate) fn resync(&mut self, instance: u64) -> SnapshotRequest {
        self.cursors.entry(instance).or_default().resyncing = true;
        SnapshotRequest::full()
    }

    /// Takes the last batch number an agent's load report says it numbered for `instance`.
    /// When the batches applied are still behind the number the report *before* said (a
    /// whole report interval for those batches to arrive), they were lost on the way (a
    /// failed publish, a partition the agent's client could not see): the gap is resynced
    /// although no later batch came to show it.
    pub(crate) fn on_reported(&mut self, instance: u64, last_seq: u64) -> Outcome {
        let mut outcome = Outcome::default();
        let Some(cursor) = self.cursors.get_mut(&instance) else {
            return outcome;
        };
        let previous = cursor.reported.replace(last_seq);
        let Some(last) = cursor.last else {
            return outcome;
        };
        if !cursor.resyncing && previous.is_some_and(|reported| reported > last) {
            outcome.gaps = 1;
            cursor.resyncing = true;
            outcome.request = Some((SnapshotRequest::from_seq(last + 1), ResyncReason::Gap));
        }
        outcome
    }

    /// Whether `instance` has applied every batch up to `last_seq` and nothing is pending:
    /// its agent's report of `last_seq` proves its index whole.
    pub(crate) fn holds_up_to(&self, instance: u64, last_seq: u64) -> bool {
        self.cursors
            .get(&instance)
            .is_some_and(|c| !c.resyncing && c.last == Some(last_seq))
    }

    /// Whether `instance` was synced once (a cursor to continue from).
    pub(crate) fn is_synced(&self, instance: u64) -> bool {
        self.cursors
            .get(&instance)
            .is_some_and(|c| c.last.is_some())
    }

    /// Forgets `instance` (it left discovery): a later batch counts as a first sight.
    pub(crate) fn forget(&mut self, instance: u64) {
        self.cursors.remove(&instance);
    }

    /// Whether a resync of `instance` is in flight.
    pub(crate) fn is_resyncing(&self, instance: u64) -> bool {
        self.cursors.get(&instance).is_some_and(|c| c.resyncing)
    }
}

fn buffer(cursor: &mut Cursor, batch: EventBatch) {
    if cursor.buffer.len() >= MAX_BUFFERED {
        cursor.buffer.clear();
        cursor.overflowed = true;
        return;
    }
    if !cursor.overflowed {
        cursor.buffer.insert(batch.seq, batch);
    }
}

/// Applies buffered batches that continue the cursor; a hole requests a replay, unless what
/// lies beyond it is numbered past `newest`, the last batch its agent said it published
/// (then it is dropped as ahead of its agent).
fn drain(cursor: &mut Cursor, outcome: &mut Outcome, newest: u64) {
    let Some(mut last) = cursor.last else {
        return;
    };
    while let Some((&seq, _)) = cursor.buffer.first_key_value() {
        if seq <= last {
            cursor.buffer.pop_first();
            outcome.stale += 1;
            continue;
        }
        if seq != last + 1 {
            if seq > newest {
                outcome.ahead += cursor.buffer.len() as u64;
                cursor.buffer.clear();
                break;
            }
            outcome.gaps += 1;
            cursor.resyncing = true;
            outcome.request = Some((SnapshotRequest::from_seq(last + 1), ResyncReason::Gap));
            break;
        }
        if let Some((_, batch)) = cursor.buffer.pop_first() {
            last = seq;
            outcome.steps.push(Step::Batch(batch));
        }
    }
    cursor.last = Some(last);
}

#[cfg(test)]
mod tests {
    use kvmesh_control::InstanceId;
    use kvmesh_kv::KvEvent;

    use super::*;

    const ID: u64 = 7;

    fn batch(seq: u64) -> EventBatch {
        EventBatch {
            instance_id: InstanceId(ID),
            dp_rank: 0,
            tier: Default::default(),
            seq,
            events: vec![KvEvent::Cleared],
        }
    }

    fn applied(outcome: &Outcome) -> Vec<u64> {
        outcome
            .steps
            .iter()
            .filter_map(|step| match step {
                Step::Batch(batch) => Some(batch.seq),
                _ => None,
            })
            .collect()
    }

    fn whole(reply: SnapshotReply) -> ReplyPart {
        ReplyPart::whole(reply)
    }

    fn snapshot(last_seq: u64) -> SnapshotReply {
        SnapshotReply::Snapshot {
            events: vec![RankedEvent {
                dp_rank: 0,
                tier: Default::default(),
                event: KvEvent::Cleared,
            }],
            last_seq,
        }
    }

    #[test]
    fn a_first_sight_buffers_until_the_snapshot() {
        let mut tracker = SequenceTracker::default();
        let first = tracker.on_batch(batch(5));
        assert_eq!(
            first.request,
            Some((SnapshotRequest::full(), ResyncReason::FirstSight))
        );
        assert!(first.steps.is_empty());
        assert!(tracker.is_resyncing(ID));
        assert_eq!(tracker.on_batch(batch(6)), Outcome::default());
        assert_eq!(tracker.on_batch(batch(7)), Outcome::default());
        // The snapshot is valid as of 5: batch 5 is stale, 6 and 7 follow.
        let reply = tracker.on_reply(ID, whole(snapshot(5)));
        assert_eq!(reply.steps[0], Step::Clear);
        assert!(matches!(reply.steps[1], Step::Snapshot(_)));
        assert_eq!(applied(&reply), [6, 7]);
        assert_eq!(reply.stale, 1);
        assert_eq!(reply.request, None);
        assert_eq!(applied(&tracker.on_batch(batch(8))), [8]);
        assert_eq!(tracker.on_batch(batch(8)).stale, 1);
    }

    #[test]
    fn a_batch_numbered_past_its_agent_is_dropped_instead_of_asked_for_forever() {
        let mut tracker = SequenceTracker::default();
        tracker.on_batch(batch(1));
        tracker.on_reply(ID, whole(snapshot(1)));
        // Someone publishes seq 50 for this instance; its agent is at 1.
        let hostile = tracker.on_batch(batch(50));
        assert_eq!(hostile.gaps, 1);
        assert_eq!(
            hostile.request,
            Some((SnapshotRequest::from_seq(2), ResyncReason::Gap))
        );
        let reply = tracker.on_reply(
            ID,
            whole(SnapshotReply::Events {
                batches: Vec::new(),
                last_seq: 1,
            }),
        );
        assert_eq!((reply.ahead, reply.gaps, reply.request), (1, 0, None));
        assert!(!tracker.is_resyncing(ID));
        // The agent's own next batch applies as usual.
        assert_eq!(applied(&tracker.on_batch(batch(2))), [2]);
    }

    /// A tracker whose instance is synced up to batch `last`.
    fn synced(last: u64) -> SequenceTracker {
        let mut tracker = SequenceTracker::default();
        tracker.on_batch(batch(last));
        tracker.on_reply(ID, whole(snapshot(last)));
        assert!(!tracker.is_resyncing(ID));
        tracker
    }

    #[test]
    fn batches_lost_with_no_later_batch_are_found_by_the_load_reports() {
        let mut tracker = synced(3);
        // The agent numbered 4 and 5; neither arrived. The first report that says so may
        // have overtaken them on the way: nothing yet.
        assert_eq!(tracker.on_reported(ID, 5).request, None);
        // A report later they are still missing: the gap is asked for.
        let lost = tracker.on_reported(ID, 5);
        assert_eq!(lost.gaps, 1);
        assert_eq!(
            lost.request,
            Some((SnapshotRequest::from_seq(4), ResyncReason::Gap))
        );
        // While that resync is in flight, reports ask for nothing more.
        assert_eq!(tracker.on_reported(ID, 6).request, None);
        // Reports that the applied batches keep up with ask for nothing.
        let mut steady = synced(3);
        for seq in 4..8 {
            assert_eq!(steady.on_reported(ID, seq).request, None);
            steady.on_batch(batch(seq));
        }
        assert_eq!(steady.on_reported(ID, 7).request, None);
        // An instance never synced, or unknown, is left to its first batch.
        assert_eq!(SequenceTracker::default().on_reported(ID, 9).request, None);
    }

    #[test]
    fn a_report_proves_the_index_whole_only_when_every_batch_it_names_was_applied() {
        let mut tracker = synced(3);
        assert!(tracker.is_synced(ID) && tracker.holds_up_to(ID, 3));
        assert!(!tracker.holds_up_to(ID, 4), "batch 4 is still on its way");
        tracker.on_batch(batch(4));
        assert!(tracker.holds_up_to(ID, 4));
        // A gap: not whole until its resync is answered.
        tracker.on_batch(batch(6));
        assert!(!tracker.holds_up_to(ID, 4) && !tracker.holds_up_to(ID, 6));
        let never = SequenceTracker::default();
        assert!(!never.is_synced(ID) && !never.holds_up_to(ID, 0));
    }

    #[test]
    fn a_gap_requests_the_missing_batches_and_applies_them_in_order() {
        let mut tracker = SequenceTracker::default();
        tracker.on_batch(batch(1));
        tracker.on_reply(ID, whole(snapshot(1)));
        let gap = tracker.on_batch(batch(4));
        assert_eq!(gap.gaps, 1);
        assert_eq!(
            gap.request,
            Some((SnapshotRequest::from_seq(2), ResyncReason::Gap))
        );
        tracker.on_batch(batch(5));
        let reply = tracker.on_reply(
            ID,
            whole(SnapshotReply::Events {
                batches: vec![batch(2), batch(3), batch(4)],
                last_seq: 4,
            }),
        );
        assert_eq!(applied(&reply), [2, 3, 4, 5]);
        assert_eq!(reply.stale, 1, "the buffered 4 was covered by the replay");
        assert_eq!(applied(&tracker.on_batch(batch(6))), [6]);
    }

    #[test]
    fn a_replay_with_a_hole_falls_back_to_a_snapshot() {
        let mut tracker = SequenceTracker::default();
        tracker.on_batch(batch(1));
        tracker.on_reply(ID, whole(snapshot(1)));
        tracker.on_batch(batch(5));
        let reply = tracker.on_reply(
            ID,
            whole(SnapshotReply::Events {
                batches: vec![batch(2), batch(4)],
                last_seq: 4,
            }),
        );
        assert_eq!(applied(&reply), [2], "what continues the cursor applies");
        assert_eq!(
            reply.request,
            Some((SnapshotRequest::full(), ResyncReason::Gap))
        );
        let snap = tracker.on_reply(ID, whole(snapshot(4)));
        assert_eq!(applied(&snap), [5]);
    }

    #[test]
    fn an_overflowing_buffer_is_dropped_and_resynced_again() {
        let mut tracker = SequenceTracker::default();
        tracker.on_batch(batch(1));
        for seq in 2..(MAX_BUFFERED as u64 + 10) {
            tracker.on_batch(batch(seq));
        }
        let reply = tracker.on_reply(ID, whole(snapshot(1)));
        assert_eq!(applied(&reply), Vec::<u64>::new());
        assert_eq!(
            reply.request,
            Some((SnapshotRequest::from_seq(2), ResyncReason::Overflow))
        );
    }

    #[test]
    fn forced_resyncs_buffer_and_forgotten_instances_start_over() {
        let mut tracker = SequenceTracker::default();
        assert_eq!(tracker.resync(ID), SnapshotRequest::full());
        assert!(tracker.is_resyncing(ID));
        assert_eq!(tracker.on_batch(batch(4)), Outcome::default(), "buffered");
        assert_eq!(applied(&tracker.on_reply(ID, whole(snapshot(3)))), [4]);
        assert!(!tracker.is_resyncing(ID));
        tracker.forget(ID);
        assert!(!tracker.is_resyncing(ID));
        assert_eq!(
            tracker.on_batch(batch(9)).request,
            Some((SnapshotRequest::full(), ResyncReason::FirstSight))
        );
        assert!(tracker.on_reply(99, whole(snapshot(1))).steps.is_empty());
    }

    fn part(reply: SnapshotReply, index: u32, parts: u32) -> ReplyPart {
        ReplyPart {
            reply,
            index,
            parts,
        }
    }

    fn kinds(outcome: &Outcome) -> Vec<&'static str> {
        outcome
            .steps
            .iter()
            .map(|step| match step {
                Step::Clear => "clear",
                Step::Snapshot(_) => "snapshot",
                Step::Batch(_) => "batch",
            })
            .collect()
    }

    #[test]
    fn a_snapshot_in_parts_applies_each_as_it_arrives_and_settles_at_the_last() {
        let mut tracker = SequenceTracker::default();
        tracker.on_batch(batch(3));
        let first = tracker.on_reply(ID, part(snapshot(3), 0, 3));
        assert_eq!(kinds(&first), ["clear", "snapshot"]);
        assert!(tracker.is_resyncing(ID) && !tracker.is_synced(ID));
        // Live batches keep waiting for the last part.
        assert!(tracker.on_batch(batch(4)).steps.is_empty());
        let middle = tracker.on_reply(ID, part(snapshot(3), 1, 3));
        assert_eq!(kinds(&middle), ["snapshot"], "only the first part clears");
        assert!(tracker.is_resyncing(ID));
        let last = tracker.on_reply(ID, part(snapshot(3), 2, 3));
        assert_eq!(kinds(&last), ["snapshot", "batch"]);
        assert_eq!(applied(&last), [4]);
        assert_eq!(last.stale, 1, "the buffered 3 was covered by the snapshot");
        assert!(!tracker.is_resyncing(ID) && tracker.holds_up_to(ID, 4));
    }

    #[test]
    fn a_replay_in_parts_applies_each_part_and_a_hole_in_a_later_part_asks_for_a_snapshot() {
        let mut tracker = synced(1);
        tracker.on_batch(batch(4));
        let events = |batches: Vec<EventBatch>| SnapshotReply::Events {
            batches,
            last_seq: 6,
        };
        let first = tracker.on_reply(ID, part(events(vec![batch(2), batch(3)]), 0, 2));
        assert_eq!(applied(&first), [2, 3]);
        assert_eq!(first.request, None);
        assert!(tracker.is_resyncing(ID));
        let second = tracker.on_reply(ID, part(events(vec![batch(4), batch(6)]), 1, 2));
        assert_eq!(applied(&second), [4]);
        assert_eq!(
            second.request,
            Some((SnapshotRequest::full(), ResyncReason::Gap))
        );
        assert!(tracker.is_resyncing(ID) && !tracker.holds_up_to(ID, 4));
    }
}

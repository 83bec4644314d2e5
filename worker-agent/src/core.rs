//! The agent's shared state: the per-rank block tables, its own batch counter and the ring
//! buffer of recent batches. One short lock per engine batch; the bus is never awaited under
//! it (published batches go, in `seq` order, through a queue to the publisher task).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvmesh_control::{EventBatch, InstanceId, RankedEvent, SnapshotReply, SnapshotRequest};
use kvmesh_engine_events::{EngineBatch, EngineEvent};
use kvmesh_kv::{CacheTier, KvEvent};
use kvmesh_telemetry::Tracer;
use opentelemetry::KeyValue;
use opentelemetry::trace::{SpanContext, SpanKind};
use tokio::sync::mpsc;

use crate::metrics::AgentMetrics;
use crate::trace::AgentSpan;
use crate::translate::{Miss, RankTable};

/// Batches kept for replay to proxies.
pub const RING_CAPACITY: usize = 4096;

/// A batch on its way to the bus.
#[derive(Debug)]
pub(crate) struct Outgoing {
    /// The JSON payload.
    pub payload: Bytes,
    /// When the engine message that produced it was received.
    pub received: Instant,
    /// The span of its translation (the publish span's parent), while tracing.
    pub trace: Option<SpanContext>,
}

struct State {
    ranks: Vec<RankTable>,
    last_seq: u64,
    ring: VecDeque<EventBatch>,
    /// The events of the batch being translated, per tier (by [`CacheTier`] order).
    scratch: [Vec<KvEvent>; 3],
    json: Vec<u8>,
}

/// The state shared by the intake, publisher and resync tasks.
pub(crate) struct Core {
    instance_id: InstanceId,
    state: Mutex<State>,
    outgoing: mpsc::Sender<Outgoing>,
    metrics: AgentMetrics,
    /// Traces each engine batch's translation (`None`: tracing is off).
    tracer: Option<Tracer>,
}

impl Core {
    /// A core for `dp_ranks` ranks of `block_size`-token blocks; batches to publish go to
    /// `outgoing`.
    pub(crate) fn new(
        instance_id: InstanceId,
        dp_ranks: u32,
        block_size: usize,
        outgoing: mpsc::Sender<Outgoing>,
        metrics: AgentMetrics,
    ) -> Result<Self, kvmesh_kv::HashError> {
        let ranks = (0..dp_ranks.max(1))
            .map(|_| RankTable::new(block_size))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            instance_id,
            state: Mutex::new(State {
                ranks,
                last_seq: 0,
                ring: VecDeque::with_capacity(RING_CAPACITY),
                scratch: Default::default(),
                json: Vec::new(),
            }),
            outgoing,
            metrics,
            tracer: None,
        })
    }

    /// The core with each batch's translation traced by `tracer`.
    pub(crate) fn with_tracer(mut self, tracer: Option<Tracer>) -> Self {
        self.tracer = tracer;
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Translates one engine batch of rank `rank` and queues the resulting kvmesh batch (if
    /// any) for publishing; returns the number of blocks stored under an unknown parent.
    pub(crate) fn apply(&self, rank: u32, batch: &EngineBatch, received: Instant) -> usize {
        let m = &self.metrics;
        let mut span = AgentSpan::start(
            self.tracer.as_ref(),
            "translate kv events",
            SpanKind::Internal,
            None,
            || {
                vec![
                    KeyValue::new("kvmesh.dp_rank", i64::from(rank)),
                    KeyValue::new("kvmesh.engine_events", batch.events.len() as i64),
                ]
            },
        );
        let mut state = self.lock();
        let state = &mut *state;
        let single_rank = state.ranks.len() == 1;
        let Some(table) = state.ranks.get_mut(rank as usize) else {
            return 0;
        };
        let out = &mut state.scratch;
        out.iter_mut().for_each(Vec::clear);
        let mut unknown_parent = 0;
        m.events_received.inc_by(batch.events.len() as u64);
        if batch.malformed_events > 0 {
            m.dropped
                .with_label_values(&["malformed_event"])
                .inc_by(batch.malformed_events as u64);
        }
        for event in &batch.events {
            match event {
                EngineEvent::Stored {
                    block_hashes,
                    parent,
                    token_ids,
                    block_size,
                    lora_name,
                    mm_hashes,
                    cache_salt,
                } => {
                    let result = table.stored(
                        *parent,
                        block_hashes,
                        token_ids,
                        *block_size,
                        lora_name.as_deref(),
                        mm_hashes,
                        cache_salt.as_deref(),
                        &mut out[0],
                    );
                    match result {
                        Ok(()) => {}
                        Err(Miss::UnknownParent) => {
                            unknown_parent += block_hashes.len();
                            m.translation_misses.inc_by(block_hashes.len() as u64);
                        }
                        Err(Miss::BlockSize) => m.dropped.with_label_values(&["block_size"]).inc(),
                        Err(Miss::TokenCount) => {
                            m.dropped.with_label_values(&["token_count"]).inc()
                        }
                    }
                }
                EngineEvent::Removed { block_hashes } => {
                    let unknown = table.removed(block_hashes, &mut out[0]);
                    m.translation_misses.inc_by(unknown as u64);
                }
                EngineEvent::TierStored { tier, block_hashes } => {
                    let unknown = table.tier_stored(*tier, block_hashes, &mut out[*tier as usize]);
                    m.translation_misses.inc_by(unknown as u64);
                }
                EngineEvent::TierRemoved { tier, block_hashes } => {
                    let unknown = table.tier_removed(*tier, block_hashes, &mut out[*tier as usize]);
                    m.translation_misses.inc_by(unknown as u64);
                }
                EngineEvent::Cleared => table.cleared(single_rank, out),
                EngineEvent::Ignored(reason) => {
                    m.dropped.with_label_values(&[reason.label()]).inc()
                }
            }
        }
        m.cached_blocks
            .set(state.ranks.iter().map(RankTable::len).sum::<usize>() as i64);
        for tier in [CacheTier::Host, CacheTier::Disk] {
            let blocks: usize = state.ranks.iter().map(|t| t.tier_len(tier)).sum();
            m.offloaded_blocks
                .with_label_values(&[tier.as_str()])
                .set(blocks as i64);
        }
        span.set(|| {
            let events: usize = state.scratch.iter().map(Vec::len).sum();
            KeyValue::new("kvmesh.kv_events", events as i64)
        });
        span.set(|| KeyValue::new("kvmesh.unknown_parent_blocks", unknown_parent as i64));
        for tier in CacheTier::ALL {
            if !state.scratch[tier as usize].is_empty() {
                let events = std::mem::take(&mut state.scratch[tier as usize]);
                self.publish_locked(state, rank, tier, events, received, span.context());
            }
        }
        span.end();
        unknown_parent
    }

    /// Forgets rank `rank`'s blocks (its engine restarted) and publishes that.
    pub(crate) fn reset_rank(&self, rank: u32) {
        let mut state = self.lock();
        let state = &mut *state;
        let single_rank = state.ranks.len() == 1;
        let Some(table) = state.ranks.get_mut(rank as usize) else {
            return;
        };
        let mut events: [Vec<KvEvent>; 3] = Default::default();
        table.cleared(single_rank, &mut events);
        for (tier, events) in CacheTier::ALL.into_iter().zip(events) {
            if !events.is_empty() {
                self.publish_locked(state, rank, tier, events, Instant::now(), None);
            }
        }
    }

    fn publish_locked(
        &self,
        state: &mut State,
        rank: u32,
        tier: CacheTier,
        events: Vec<KvEvent>,
        received: Instant,
        trace: Option<SpanContext>,
    ) {
        state.last_seq += 1;
        let batch = EventBatch {
            instance_id: self.instance_id,
            dp_rank: rank,
            tier,
            seq: state.last_seq,
            events,
        };
        state.json.clear();
        batch.write_json_at(unix_ms(), &mut state.json);
        let payload = Bytes::copy_from_slice(&state.json);
        let m = &self.metrics;
        m.events_published.inc_by(batch.events.len() as u64);
        m.blocks_published.inc_by(batch.block_count() as u64);
        m.batches_published.inc();
        if state.ring.len() == RING_CAPACITY {
            // Reuse the evicted batch's event vector as the next scratch buffer.
            if let Some(old) = state.ring.pop_front()
                && let Some(scratch) = state.scratch.iter_mut().find(|s| s.capacity() == 0)
            {
                *scratch = old.events;
                scratch.clear();
            }
        }
        state.ring.push_back(batch);
        if self
            .outgoing
            .try_send(Outgoing {
                payload,
                received,
                trace,
            })
            .is_err()
        {
            // The proxies see the gap in `seq` and replay it from the ring buffer.
            m.dropped.with_label_values(&["publish_queue"]).inc();
        }
    }

    /// The data-parallel ranks it has a table for.
    pub(crate) fn dp_ranks(&self) -> u32 {
        self.lock().ranks.len() as u32
    }

    /// The instance whose batches it numbers.
    pub(crate) fn instance_id(&self) -> InstanceId {
        self.instance_id
    }

    /// The newest published batch number.
    pub(crate) fn last_seq(&self) -> u64 {
        self.lock().last_seq
    }

    /// Answers a resync request: the batches from `from_seq` when the ring still has them,
    /// else a full snapshot.
    pub(crate) fn resync(&self, request: SnapshotRequest) -> SnapshotReply {
        let state = self.lock();
        if let Some(from) = request.from_seq {
            let from = from.max(1);
            if from > state.last_seq {
                return SnapshotReply::Events {
                    batches: Vec::new(),
                    last_seq: state.last_seq,
                };
            }
            if let Some(oldest) = state.ring.front()
                && oldest.seq <= from
            {
                let skip = (from - oldest.seq) as usize;
                return SnapshotReply::Events {
                    batches: state.ring.iter().skip(skip).cloned().collect(),
                    last_seq: state.last_seq,
                };
            }
        }
        let mut events = Vec::new();
        for (rank, table) in state.ranks.iter().enumerate() {
            let dp_rank = rank as u32;
            for tier in CacheTier::ALL {
                events.extend(
                    table
                        .tier_snapshot(tier)
                        .into_iter()
                        .map(|event| RankedEvent {
                            dp_rank,
                            tier,
                            event,
                        }),
                );
            }
        }
        SnapshotReply::Snapshot {
            events,
            last_seq: state.last_seq,
        }
    }
}

/// Now, in Unix milliseconds (a live batch's `at_ms`).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

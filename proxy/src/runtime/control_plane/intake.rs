//! Event intake: KV event batches and load reports from the event bus into each
//! `policy: kv` model's index and load accounting.
//!
//! One task (an actor: every index write for an instance happens here, in order) reads
//! `{ns}.kv.*`, `{ns}.load.*`, the instances that discovery adds and removes, the answers to
//! resync requests and the bus connection state:
//!
//! - A batch from an instance discovery lists, of a `policy: kv` model, goes through the
//!   instance's [`SequenceTracker`]: applied in order, stale ones dropped, a gap or a first
//!   sight triggers a resync (`{ns}.snapshot.{instance_id}`, see the tracker for the
//!   buffering). Batches from unknown instances are dropped (when the instance joins later,
//!   its snapshot covers them). Undecodable payloads are counted, never fatal.
//! - An instance that joins is resynced at once (an idle engine publishes nothing); one that
//!   leaves loses its blocks.
//! - Resync requests run in their own tasks (at most [`MAX_CONCURRENT_RESYNCS`] at a time),
//!   retried with backoff (200 ms doubling to 5 s) until answered or superseded.
//! - A batch whose blocks the index cannot place (unknown parent, broken chain) triggers a
//!   full resync of that instance, at most once per [`REPAIR_INTERVAL`].
//! - **Bus down**: every model falls back to approximate mode (its predictions), and
//!   `kvmesh_events_connected` drops to 0. **Bus back** (a new connection epoch): an
//!   instance synced before is checked, not resynced: the first load report whose `last_seq`
//!   its applied batches reach proves its index whole; batches lost meanwhile show as a
//!   gap (a later batch, or reports the applied ones stay behind) and are asked for from
//!   there. One whose agent does not prove it within `events.load_report_ttl` (an agent
//!   that does not report `last_seq`), or that was never synced, is resynced from a full
//!   snapshot. A model switches back to its event-fed index once all its instances are
//!   proven or answered.
//! - Load reports refresh the reporting instance's reported load (see
//!   `kvmesh_route::kv`), valid for `events.load_report_ttl`.
//! - An instance whose answers' `cached_tokens` kept disagreeing with the index
//!   (`kv.cache_check`) is resynced; the snapshot's answer makes it trusted again.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvmesh_control::{
    ConnectionState, ControlError, DecisionShare, EventBatch, EventBus, HexU64, InstanceId,
    InstanceLoadShare, LoadReport, LoadShare, Message, Namespace, ReplyAssembler, ReplyPart,
    SessionShare, SnapshotRequest, Subscription, TokenCostShare,
};
use kvmesh_kv::{KvEvent, WorkerKey};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::AbortHandle;

use kvmesh_route::kv::{
    EventFeed, OwnLoads, ReplicaShare, SessionBinding, SharedDecision, SharedLoad, SharedSpeed,
    TokenCostSums,
};

use crate::engines::pool::ModelPool;
use crate::runtime::control_plane::decider::{DecideLink, block_hashes, hex_local, hex_sequence};
use crate::runtime::control_plane::metrics::{ControlMetrics, Dropped, Malformed};
use crate::runtime::control_plane::sequence::{Outcome, ResyncReason, SequenceTracker, Step};
use crate::runtime::heap;

/// Resync requests in flight at once.
pub(crate) const MAX_CONCURRENT_RESYNCS: usize = 16;
/// Shortest time between two repair resyncs of one instance.
pub(crate) const REPAIR_INTERVAL: Duration = Duration::from_secs(5);
/// Parts of resync answers decoded ahead of the intake: a reader waits for the intake to
/// apply what it sent, so a large snapshot is held a few parts at a time, never whole.
const ANSWER_PARTS_IN_FLIGHT: usize = 4;
/// First pause before a failed resync request is sent again.
const RETRY_FIRST: Duration = Duration::from_millis(200);
/// Longest pause between resync attempts.
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What discovery tells the intake.
#[derive(Debug)]
pub(crate) enum IntakeInput {
    /// Instance `id` joined `pool`; its agent answers resyncs on `snapshot_subject`.
    Joined {
        /// The instance id.
        id: u64,
        /// Its model's pool.
        pool: Arc<ModelPool>,
        /// Where its agent answers resync requests.
        snapshot_subject: String,
        /// Its data-parallel ranks (at least 1): batches of another rank are dropped.
        dp_ranks: u32,
    },
    /// Instance `id` left.
    Left {
        /// The instance id.
        id: u64,
    },
}

/// Settings of the intake.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IntakeSettings {
    /// Time allowed for one resync request.
    pub(crate) resync_timeout: Duration,
    /// How long a load report counts.
    pub(crate) load_report_ttl: Duration,
}

/// The intake's inputs, subscribed before the proxy announces readiness.
pub(crate) struct Intake {
    bus: Arc<dyn EventBus>,
    events: Subscription,
    loads: Subscription,
    sessions: Subscription,
    replica_loads: Subscription,
    decisions: Subscription,
    subjects: ReplicaSubjects,
    inputs: mpsc::UnboundedReceiver<IntakeInput>,
    settings: IntakeSettings,
    metrics: ControlMetrics,
}

impl std::fmt::Debug for Intake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Intake")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// Where proxy replicas share with each other.
#[derive(Debug, Clone)]
struct ReplicaSubjects {
    sessions: String,
    load: String,
    decisions: String,
    /// For the subjects where each replica decides for a model's other replicas.
    namespace: Namespace,
}

/// A replica shares its load at every change (a booking, a first token, a release) and at
/// least this often, changed or not.
const LOAD_SHARE_HEARTBEAT: Duration = Duration::from_secs(1);
/// How long a replica's shared load counts: a few heartbeats.
const LOAD_SHARE_TTL: Duration = Duration::from_secs(3);

/// Shares one model's session bindings and in-flight load with the other replicas, and
/// starts its link to the model's decider ([`DecideLink`]).
struct Sharer {
    bus: Arc<dyn EventBus>,
    subjects: ReplicaSubjects,
    replica: HexU64,
    model: String,
    metrics: ControlMetrics,
}

impl Sharer {
    /// Runs until `pool` is retired or dropped. Publishing is best effort: while NATS is
    /// down, the other replicas' copies expire and each routes on its own bookings.
    async fn run(self, pool: Weak<ModelPool>) {
        let (mut bindings, mut decisions) = match pool.upgrade() {
            Some(pool) => match pool.balancer().kv_router() {
                Some(router) => {
                    if let Some(asks) = router.serve_asks(self.replica.0) {
                        let link = DecideLink {
                            bus: Arc::clone(&self.bus),
                            namespace: self.subjects.namespace.clone(),
                            replica: self.replica,
                            model: self.model.clone(),
                            metrics: self.metrics.clone(),
                        };
                        link.start(asks, Arc::downgrade(&pool)).await;
                    }
                    (router.share_sessions(), router.share_decisions())
                }
                None => return,
            },
            None => return,
        };
        let mut tick = tokio::time::interval(LOAD_SHARE_HEARTBEAT);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut seq = 0;
        let mut last: Option<(OwnLoads, u64)> = None;
        loop {
            let Some(alive) = pool.upgrade().filter(|pool| !pool.is_retired()) else {
                return;
            };
            let binding = async {
                match bindings.as_mut() {
                    Some(bindings) => bindings.recv().await,
                    None => std::future::pending().await,
                }
            };
            let decision = async {
                match decisions.as_mut() {
                    Some(decisions) => decisions.recv().await,
                    None => std::future::pending().await,
                }
            };
            let heartbeat = tokio::select! {
                Some(binding) = binding => {
                    self.publish_session(binding).await;
                    continue;
                }
                Some(decision) = decision => {
                    self.publish_decision(decision).await;
                    continue;
                }
                () = own_changed(&alive) => false,
                _ = tick.tick() => true,
            };
            let Some(router) = alive.balancer().kv_router() else {
                return;
            };
            router.expire_replica_loads();
            let own = (router.own_loads(), router.decided());
            drop(alive);
            if heartbeat || last.as_ref() != Some(&own) {
                seq += 1;
                self.publish_load(seq, &own.0, own.1).await;
                last = Some(own);
            }
        }
    }

    /// Publishes a routing decision this replica made.
    async fn publish_decision(&self, decision: SharedDecision) {
        let hashes = &decision.prompt.hashes;
        let share = DecisionShare {
            replica: self.replica,
            model: self.model.clone(),
            instance_id: InstanceId(decision.instance),
            local: hex_local(hashes),
            sequence: hex_sequence(hashes),
        };
        let _ = self
            .bus
            .publish(&self.subjects.decisions, Bytes::from(share.to_json()))
            .await;
    }

    /// Publishes a binding this replica made.
    async fn publish_session(&self, binding: SessionBinding) {
        let share = SessionShare {
            replica: self.replica,
            model: self.model.clone(),
            session: binding.session.to_string(),
            instance_id: InstanceId(binding.instance),
            ttl_ms: binding.ttl.as_millis() as u64,
        };
        let _ = self
            .bus
            .publish(&self.subjects.sessions, Bytes::from(share.to_json()))
            .await;
    }

    /// Publishes this replica's share number `seq` of its in-flight load, in which its asks
    /// of the decider up to `decided` are settled.
    async fn publish_load(&self, seq: u64, own: &OwnLoads, decided: u64) {
        let share = LoadShare {
            replica: self.replica,
            decided,
            eased: own.eased,
            seq,
            model: self.model.clone(),
            ttl_ms: LOAD_SHARE_TTL.as_millis() as u64,
            instances: own
                .loads
                .iter()
                .filter(|(_, load)| load.requests > 0 || load.speed.samples > 0)
                .map(|(&instance, load)| InstanceLoadShare {
                    instance_id: InstanceId(instance),
                    prefill_tokens: load.prefill_tokens,
                    blocks: load.blocks,
                    requests: load.requests,
                    prefill_requests: load.prefill_requests,
                    speed_ln_factor: load.speed.ln_factor,
                    speed_ln_variance: load.speed.ln_variance,
                    speed_samples: load.speed.samples,
                })
                .collect(),
            token_cost: TokenCostShare {
                weight: own.token_cost.weight,
                share: own.token_cost.share,
                ratio: own.token_cost.ratio,
                share_squared: own.token_cost.share_squared,
                share_ratio: own.token_cost.share_ratio,
            },
        };
        let _ = self
            .bus
            .publish(&self.subjects.load, Bytes::from(share.to_json()))
            .await;
    }
}

/// Completes when `pool`'s own in-flight load changed (never for a pool without a KV
/// router).
async fn own_changed(pool: &ModelPool) {
    match pool.balancer().kv_router() {
        Some(router) => router.own_loads_changed().await,
        None => std::future::pending().await,
    }
}

/// One part of the answer to a resync request, or why the answer could not be read.
struct ResyncAnswer {
    id: u64,
    generation: u64,
    part: Result<ReplyPart, ControlError>,
}

/// An instance the intake feeds.
struct Member {
    model: String,
    feed: Arc<EventFeed>,
    pool: Arc<ModelPool>,
    snapshot_subject: String,
    /// Its data-parallel ranks: events of rank `dp_ranks` and above are not its engine's.
    dp_ranks: u32,
}

/// A model whose index the intake feeds.
struct ModelSync {
    feed: Arc<EventFeed>,
    /// Instances whose first resync since the (re)connection is not in yet.
    awaiting: HashSet<u64>,
    members: HashSet<u64>,
}

/// Counts the batches `events` dropped since `counted` (the bus drops what a subscriber
/// too far behind cannot take; the sequence numbers then show a gap and trigger a resync);
/// returns the new total.
fn count_overflow(metrics: &ControlMetrics, events: &Subscription, counted: u64) -> u64 {
    let dropped = events.dropped();
    metrics.dropped(Dropped::Overflow, dropped.saturating_sub(counted));
    dropped
}

/// A resync request in flight.
struct Pending {
    generation: u64,
    task: AbortHandle,
}

impl Intake {
    /// Subscribes to the KV event and load subjects of `namespace` on `bus`; on failure the
    /// inputs come back with the error, for another try.
    pub(crate) async fn subscribe(
        bus: Arc<dyn EventBus>,
        namespace: &kvmesh_control::Namespace,
        inputs: mpsc::UnboundedReceiver<IntakeInput>,
        settings: IntakeSettings,
        metrics: ControlMetrics,
    ) -> Result<Self, (ControlError, mpsc::UnboundedReceiver<IntakeInput>)> {
        let subjects = ReplicaSubjects {
            sessions: namespace.sessions_subject(),
            load: namespace.replica_load_subject(),
            decisions: namespace.decisions_subject(),
            namespace: namespace.clone(),
        };
        let subscriptions = async {
            let events = bus
                .subscribe_durable(&namespace.all_events_subject())
                .await?;
            let loads = bus.subscribe(&namespace.all_load_subject()).await?;
            let sessions = bus.subscribe(&subjects.sessions).await?;
            let replica_loads = bus.subscribe(&subjects.load).await?;
            let decisions = bus.subscribe(&subjects.decisions).await?;
            Ok::<_, ControlError>((events, loads, [sessions, replica_loads, decisions]))
        };
        match subscriptions.await {
            Ok((events, loads, [sessions, replica_loads, decisions])) => Ok(Self {
                bus,
                events,
                loads,
                sessions,
                replica_loads,
                decisions,
                subjects,
                inputs,
                settings,
                metrics,
            }),
            Err(error) => Err((error, inputs)),
        }
    }

    /// Runs until the bus shuts down.
    pub(crate) async fn run(self) {
        let Self {
            bus,
            mut events,
            mut loads,
            mut sessions,
            mut replica_loads,
            mut decisions,
            subjects,
            mut inputs,
            settings,
            metrics,
        } = self;
        let mut connection = bus.connection_state();
        let (answers_tx, mut answers) = mpsc::channel(ANSWER_PARTS_IN_FLIGHT);
        let (untrusted_tx, mut untrusted) = mpsc::unbounded_channel();
        let (deadlines_tx, mut deadlines) = mpsc::unbounded_channel();
        let durable = bus.is_durable();
        let mut actor = Actor {
            bus,
            settings,
            metrics,
            answers: answers_tx,
            untrusted: untrusted_tx,
            permits: Arc::new(Semaphore::new(MAX_CONCURRENT_RESYNCS)),
            members: HashMap::new(),
            models: HashMap::new(),
            tracker: SequenceTracker::default(),
            pending: HashMap::new(),
            generation: 0,
            last_repair: HashMap::new(),
            connected: false,
            epoch: 0,
            verifying: HashMap::new(),
            large_reply_applied: false,
            deadlines: deadlines_tx,
            durable,
            replica: rand::random(),
            subjects,
        };
        let initial = *connection.borrow_and_update();
        actor.on_connection(initial);
        let mut overflowed = 0;
        loop {
            tokio::select! {
                message = events.next() => match message {
                    Some(message) => {
                        overflowed = count_overflow(&actor.metrics, &events, overflowed);
                        actor.on_batch(&message);
                    }
                    None => break,
                },
                Some(message) = loads.next() => actor.on_load(&message),
                Some(message) = sessions.next() => actor.on_session(&message),
                Some(message) = replica_loads.next() => actor.on_replica_load(&message),
                Some(message) = decisions.next() => actor.on_decision(&message),
                Some(input) = inputs.recv() => actor.on_input(input),
                Some(answer) = answers.recv() => actor.on_answer(answer),
                Some(id) = untrusted.recv() => actor.on_untrusted(id),
                Some((id, epoch)) = deadlines.recv() => actor.on_check_deadline(id, epoch),
                changed = connection.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let state = *connection.borrow_and_update();
                    actor.on_connection(state);
                }
            }
        }
        actor.on_connection(ConnectionState::Disconnected);
        tracing::warn!("event bus closed: KV event intake stopped");
    }
}

struct Actor {
    bus: Arc<dyn EventBus>,
    settings: IntakeSettings,
    metrics: ControlMetrics,
    answers: mpsc::Sender<ResyncAnswer>,
    /// Where the models' event feeds name the instances their cache check untrusted.
    untrusted: mpsc::UnboundedSender<u64>,
    permits: Arc<Semaphore>,
    members: HashMap<u64, Member>,
    models: HashMap<String, ModelSync>,
    tracker: SequenceTracker,
    pending: HashMap<u64, Pending>,
    generation: u64,
    last_repair: HashMap<u64, Instant>,
    connected: bool,
    epoch: u64,
    /// Instances being checked after a reconnection, with its epoch.
    verifying: HashMap<u64, u64>,
    /// A resync answered in several parts was applied since free heap was last returned.
    large_reply_applied: bool,
    /// Where a check's deadline arrives, as (instance, epoch).
    deadlines: mpsc::UnboundedSender<(u64, u64)>,
    /// Whether the KV events come through a durable subscription (JetStream): after a
    /// reconnect it replays what was missed, so no instance is asked again.
    durable: bool,
    /// This proxy's replica id in what it shares with the other replicas.
    replica: u64,
    /// Where replicas share.
    subjects: ReplicaSubjects,
}

impl Actor {
    /// Takes in a session binding another proxy replica shared.
    fn on_session(&mut self, message: &Message) {
        let share = match SessionShare::from_json(&message.payload) {
            Ok(share) => share,
            Err(error) => {
                self.metrics.malformed(Malformed::Session);
                tracing::debug!(%error, "malformed session binding");
                return;
            }
        };
        if let Some(pool) = self.shared_pool(share.replica, &share.model)
            && let Some(router) = pool.balancer().kv_router()
        {
            router.apply_session(SessionBinding {
                session: Arc::from(share.session),
                instance: share.instance_id.0,
                ttl: Duration::from_millis(share.ttl_ms),
            });
        }
    }

    /// Takes in the in-flight load another proxy replica shared.
    fn on_replica_load(&mut self, message: &Message) {
        let share = match LoadShare::from_json(&message.payload) {
            Ok(share) => share,
            Err(error) => {
                self.metrics.malformed(Malformed::ReplicaLoad);
                tracing::debug!(%error, "malformed replica load");
                return;
            }
        };
        if let Some(pool) = self.shared_pool(share.replica, &share.model)
            && let Some(router) = pool.balancer().kv_router()
        {
            let loads = share
                .instances
                .iter()
                .map(|load| {
                    let shared = SharedLoad {
                        prefill_tokens: load.prefill_tokens,
                        blocks: load.blocks,
                        requests: load.requests,
                        prefill_requests: load.prefill_requests,
                        speed: SharedSpeed {
                            ln_factor: load.speed_ln_factor,
                            ln_variance: load.speed_ln_variance,
                            samples: load.speed_samples,
                        },
                    };
                    (load.instance_id.0, shared)
                })
                .collect();
            let taken = ReplicaShare {
                seq: share.seq,
                ttl: Duration::from_millis(share.ttl_ms),
                own: OwnLoads {
                    token_cost: TokenCostSums {
                        weight: share.token_cost.weight,
                        share: share.token_cost.share,
                        ratio: share.token_cost.ratio,
                        share_squared: share.token_cost.share_squared,
                        share_ratio: share.token_cost.share_ratio,
                    },
                    eased: share.eased,
                    loads,
                },
                decided: share.decided,
            };
            router.apply_replica_loads(share.replica.0, taken);
        }
    }

    /// Takes in a routing decision another proxy replica shared.
    fn on_decision(&mut self, message: &Message) {
        let share = match DecisionShare::from_json(&message.payload) {
            Ok(share) => share,
            Err(error) => {
                self.metrics.malformed(Malformed::Decision);
                tracing::debug!(%error, "malformed replica decision");
                return;
            }
        };
        if let Some(pool) = self.shared_pool(share.replica, &share.model)
            && let Some(router) = pool.balancer().kv_router()
        {
            let hashes = block_hashes(&share.local, &share.sequence);
            router.apply_decision(share.instance_id.0, &hashes);
        }
    }

    /// The pool of `model` that another replica's share applies to: `None` for this
    /// replica's own shares, or a model the intake does not feed.
    fn shared_pool(&self, replica: HexU64, model: &str) -> Option<Arc<ModelPool>> {
        if replica.0 == self.replica {
            return None;
        }
        let sync = self.models.get(model)?;
        let member = sync.members.iter().find_map(|id| self.members.get(id))?;
        Some(Arc::clone(&member.pool))
    }

    /// Starts sharing `pool`'s session bindings and in-flight load with the other replicas,
    /// until the pool is retired.
    fn share(&self, pool: &Arc<ModelPool>) {
        if pool.balancer().kv_router().is_none() {
            return;
        }
        let sharer = Sharer {
            bus: Arc::clone(&self.bus),
            subjects: self.subjects.clone(),
            replica: HexU64(self.replica),
            model: pool.name().to_string(),
            metrics: self.metrics.clone(),
        };
        tokio::spawn(sharer.run(Arc::downgrade(pool)));
    }

    fn on_batch(&mut self, message: &Message) {
        let (batch, at_ms) = match EventBatch::from_json_at(&message.payload) {
            Ok(stamped) => stamped,
            Err(error) => {
                self.metrics.malformed(Malformed::Batch);
                tracing::debug!(subject = %message.subject, %error, "malformed KV event batch");
                return;
            }
        };
        let id = batch.instance_id.0;
        let Some(member) = self.members.get(&id) else {
            self.metrics.dropped(Dropped::UnknownInstance, 1);
            return;
        };
        if let Some(at_ms) = at_ms {
            self.metrics.observe_lag(&member.model, at_ms);
        }
        let outcome = self.tracker.on_batch(batch);
        self.execute(id, outcome);
    }

    fn on_load(&mut self, message: &Message) {
        let report = match LoadReport::from_json(&message.payload) {
            Ok(report) => report,
            Err(error) => {
                self.metrics.malformed(Malformed::Load);
                tracing::debug!(subject = %message.subject, %error, "malformed load report");
                return;
            }
        };
        let id = report.instance_id.0;
        let Some(member) = self.members.get(&id) else {
            return;
        };
        if let Some(router) = member.pool.balancer().kv_router() {
            // How long ago the engine was scraped: `age_ms` before publishing, on the agent's
            // own clock (the bus adds milliseconds); from older agents, `at_ms` on the
            // agent's clock against this proxy's (0 when unknown).
            let age_ms = report.age_ms.unwrap_or_else(|| {
                let now_ms = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |now| now.as_millis() as u64);
                now_ms.saturating_sub(report.at_ms)
            });
            let age = Duration::from_millis(age_ms).min(self.settings.load_report_ttl);
            router.report_load(
                id,
                report.waiting,
                report.kv_usage,
                age,
                self.settings.load_report_ttl,
            );
            if member
                .feed
                .set_events_incomplete(id, !report.events_complete)
            {
                if report.events_complete {
                    tracing::info!(instance = %member.pool.name(), id = %format_args!("{id:016x}"), "the agent's view of its engine's KV cache is whole again: scored by its KV events");
                } else {
                    tracing::warn!(model = %member.pool.name(), id = %format_args!("{id:016x}"), "the agent lost KV events its engine could not replay: scoring the instance by predictions alone until its engine clears its cache or restarts");
                }
            }
            self.metrics
                .load_reports
                .with_label_values(&[member.model.as_str()])
                .inc();
        }
        // A durable stream's consumer may lag far behind the reports, and loses nothing.
        if let Some(last_seq) = report.last_seq
            && self.connected
            && !self.durable
        {
            let outcome = self.tracker.on_reported(id, last_seq);
            self.execute(id, outcome);
        }
        if self.verifying.contains_key(&id) {
            match report.last_seq {
                Some(last_seq) if self.tracker.holds_up_to(id, last_seq) => self.proven(id),
                // Still behind: the next report (or batch) shows the gap, or this one's
                // batches arrive.
                Some(_) => {}
                None => {
                    self.verifying.remove(&id);
                    let request = self.tracker.resync(id);
                    self.request(id, request, ResyncReason::Reconnect, Duration::ZERO);
                }
            }
        }
    }

    /// Instance `id`'s agent proved its index whole after a reconnection.
    fn proven(&mut self, id: u64) {
        self.verifying.remove(&id);
        tracing::debug!(id = %format_args!("{id:016x}"), "nothing lost while the bus was away");
        self.settled(id);
    }

    /// Instance `id`'s index is whole (resynced, or proven after a reconnection): its model
    /// waits no more for it.
    fn settled(&mut self, id: u64) {
        let Some(member) = self.members.get(&id) else {
            return;
        };
        let model = member.model.clone();
        if let Some(sync) = self.models.get_mut(&model) {
            sync.awaiting.remove(&id);
        }
        self.update_live(&model);
    }

    /// The check of instance `id` begun at `epoch` ran out: resync it unless proven.
    fn on_check_deadline(&mut self, id: u64, epoch: u64) {
        if self.verifying.get(&id) != Some(&epoch) {
            return;
        }
        self.verifying.remove(&id);
        if self.connected && !self.tracker.is_resyncing(id) {
            let request = self.tracker.resync(id);
            self.request(id, request, ResyncReason::Reconnect, Duration::ZERO);
        }
    }

    fn on_input(&mut self, input: IntakeInput) {
        match input {
            IntakeInput::Joined {
                id,
                pool,
                snapshot_subject,
                dp_ranks,
            } => self.join(id, pool, snapshot_subject, dp_ranks),
            IntakeInput::Left { id } => self.leave(id),
        }
    }

    fn join(&mut self, id: u64, pool: Arc<ModelPool>, snapshot_subject: String, dp_ranks: u32) {
        let Some(router) = pool.balancer().kv_router() else {
            return;
        };
        let Some(feed) = router.event_feed().cloned() else {
            return;
        };
        let model = pool.name().to_string();
        let new_pool = self
            .models
            .get(&model)
            .is_none_or(|sync| !Arc::ptr_eq(&sync.feed, &feed));
        if new_pool {
            self.share(&pool);
        }
        feed.resync_requests_to(self.untrusted.clone());
        let sync = self
            .models
            .entry(model.clone())
            .or_insert_with(|| ModelSync {
                feed: Arc::clone(&feed),
                awaiting: HashSet::new(),
                members: HashSet::new(),
            });
        if !Arc::ptr_eq(&sync.feed, &feed) {
            // The model left and came back as a new pool.
            *sync = ModelSync {
                feed: Arc::clone(&feed),
                awaiting: HashSet::new(),
                members: HashSet::new(),
            };
        }
        sync.members.insert(id);
        let first = !feed.is_live();
        if first && self.connected {
            sync.awaiting.insert(id);
        }
        self.members.insert(
            id,
            Member {
                model: model.clone(),
                feed,
                pool,
                snapshot_subject,
                dp_ranks: dp_ranks.max(1),
            },
        );
        self.tracker.forget(id);
        if self.connected {
            let request = self.tracker.resync(id);
            self.request(id, request, ResyncReason::FirstSight, Duration::ZERO);
        }
        self.update_live(&model);
    }

    fn leave(&mut self, id: u64) {
        self.tracker.forget(id);
        self.verifying.remove(&id);
        self.last_repair.remove(&id);
        if let Some(pending) = self.pending.remove(&id) {
            pending.task.abort();
        }
        let Some(member) = self.members.remove(&id) else {
            return;
        };
        // Batches applied after the pool dropped the instance must not linger.
        clear_off_runtime(&member.feed, id);
        if let Some(sync) = self.models.get_mut(&member.model) {
            sync.members.remove(&id);
            sync.awaiting.remove(&id);
            if sync.members.is_empty() && member.pool.is_retired() {
                self.models.remove(&member.model);
                return;
            }
        }
        self.update_live(&member.model);
    }

    fn on_answer(&mut self, answer: ResyncAnswer) {
        let current = self
            .pending
            .get(&answer.id)
            .is_some_and(|pending| pending.generation == answer.generation);
        if !current {
            return;
        }
        match answer.part {
            Ok(part) => {
                let complete = part.is_last();
                let parts = part.parts;
                if complete {
                    self.pending.remove(&answer.id);
                    self.verifying.remove(&answer.id);
                }
                let outcome = self.tracker.on_reply(answer.id, part);
                self.execute(answer.id, outcome);
                if complete {
                    if let Some(member) = self.members.get(&answer.id) {
                        member.feed.trust(answer.id);
                    }
                    self.settled(answer.id);
                    self.large_reply_applied |= parts > 1;
                    if self.large_reply_applied && self.pending.is_empty() {
                        // The tables the index outgrew and the decoded parts are free heap now.
                        self.large_reply_applied = false;
                        tokio::task::spawn_blocking(heap::release_free_heap);
                    }
                }
            }
            Err(error) => {
                self.pending.remove(&answer.id);
                self.verifying.remove(&answer.id);
                self.metrics.malformed(Malformed::Snapshot);
                tracing::warn!(id = %format_args!("{:016x}", answer.id), %error, "unreadable resync answer; asking again");
                let request = self.tracker.resync(answer.id);
                self.request(answer.id, request, ResyncReason::Retry, RETRY_MAX);
            }
        }
    }

    /// Instance `id`'s answers disagreed with the index too often: resync it (its feed
    /// trusts it again when the snapshot's answer is applied).
    fn on_untrusted(&mut self, id: u64) {
        if !self.members.contains_key(&id) {
            return;
        }
        tracing::info!(id = %format_args!("{id:016x}"), "resyncing an instance its cache check untrusted");
        if self.connected && !self.tracker.is_resyncing(id) {
            let request = self.tracker.resync(id);
            self.request(id, request, ResyncReason::CacheCheck, Duration::ZERO);
        }
    }

    fn on_connection(&mut self, state: ConnectionState) {
        match state {
            ConnectionState::Disconnected => {
                if self.connected {
                    tracing::warn!("event bus disconnected: approximate routing until it is back");
                }
                self.connected = false;
                self.metrics.events_connected.set(0);
                self.verifying.clear();
                for (_, pending) in self.pending.drain() {
                    pending.task.abort();
                }
                let models: Vec<String> = self.models.keys().cloned().collect();
                for model in models {
                    self.update_live(&model);
                }
            }
            ConnectionState::Connected { epoch } => {
                if self.connected && epoch <= self.epoch {
                    return;
                }
                let reconnect = self.epoch > 0;
                let reason = if reconnect {
                    ResyncReason::Reconnect
                } else {
                    ResyncReason::FirstSight
                };
                let replayed = reconnect && self.durable;
                self.connected = true;
                self.epoch = epoch;
                self.metrics.events_connected.set(1);
                if replayed {
                    // Gaps the replay cannot fill still resync, through the sequence numbers.
                    tracing::info!(
                        epoch,
                        "event bus reconnected: the stream replays the batches missed meanwhile"
                    );
                    let models: Vec<String> = self.models.keys().cloned().collect();
                    for model in models {
                        self.update_live(&model);
                    }
                    return;
                }
                if reconnect {
                    tracing::info!(
                        epoch,
                        "event bus reconnected: checking each instance's batch numbers"
                    );
                }
                for sync in self.models.values_mut() {
                    sync.awaiting = sync.members.clone();
                }
                let ids: Vec<u64> = self.members.keys().copied().collect();
                for id in ids {
                    // Synced before and nothing pending: its agent's next load report proves
                    // it whole, or shows what was lost.
                    if reconnect && self.tracker.is_synced(id) && !self.tracker.is_resyncing(id) {
                        self.verifying.insert(id, epoch);
                        let deadlines = self.deadlines.clone();
                        let window = self.settings.load_report_ttl;
                        tokio::spawn(async move {
                            tokio::time::sleep(window).await;
                            let _ = deadlines.send((id, epoch));
                        });
                        continue;
                    }
                    let request = self.tracker.resync(id);
                    self.request(id, request, reason, Duration::ZERO);
                }
                let models: Vec<String> = self.models.keys().cloned().collect();
                for model in models {
                    self.update_live(&model);
                }
            }
        }
    }

    /// Reads the model's overlaps from its event-fed index while the bus is connected and
    /// every instance present at the (re)connection has been resynced.
    fn update_live(&self, model: &str) {
        let Some(sync) = self.models.get(model) else {
            return;
        };
        let live = self.connected && sync.awaiting.is_empty();
        if sync.feed.is_live() != live {
            tracing::info!(
                model,
                source = if live { "events" } else { "approximate" },
                "KV index source changed"
            );
        }
        sync.feed.set_live(live);
        self.metrics.set_index_source(model, live);
    }

    /// Applies what the tracker decided for instance `id`.
    fn execute(&mut self, id: u64, outcome: Outcome) {
        let Some(member) = self.members.get(&id) else {
            return;
        };
        let model = member.model.as_str();
        let mut needs_repair = false;
        // An engine of another block size than its model: its blocks could never match.
        let approximate_only = member.feed.is_approximate_only(id);
        for step in outcome.steps {
            match step {
                Step::Snapshot(_) | Step::Batch(_) if approximate_only => {
                    self.metrics.dropped(Dropped::BlockSizeMismatch, 1);
                }
                Step::Clear => clear_before_snapshot(&member.feed, id),
                // A rank the instance does not have: not its engine's events.
                Step::Snapshot(ranked) if ranked.dp_rank >= member.dp_ranks => {
                    self.metrics.dropped(Dropped::UnknownRank, 1);
                }
                Step::Batch(batch) if batch.dp_rank >= member.dp_ranks => {
                    self.metrics.dropped(Dropped::UnknownRank, 1);
                }
                Step::Snapshot(ranked) => {
                    let worker = WorkerKey::new(id, ranked.dp_rank).in_tier(ranked.tier);
                    needs_repair |= self.apply(model, member, worker, &ranked.event);
                }
                Step::Batch(batch) => {
                    let worker = WorkerKey::new(id, batch.dp_rank).in_tier(batch.tier);
                    for event in &batch.events {
                        needs_repair |= self.apply(model, member, worker, event);
                    }
                }
            }
        }
        if outcome.gaps > 0 {
            self.metrics
                .event_gaps
                .with_label_values(&[model])
                .inc_by(outcome.gaps);
        }
        self.metrics.dropped(Dropped::Stale, outcome.stale);
        if outcome.ahead > 0 {
            self.metrics.dropped(Dropped::AheadOfAgent, outcome.ahead);
            tracing::warn!(id = %format_args!("{id:016x}"), batches = outcome.ahead, "dropped KV event batches numbered past what the instance's agent published");
        }
        if let Some((request, reason)) = outcome.request {
            self.request(id, request, reason, Duration::ZERO);
        } else if needs_repair && !self.tracker.is_resyncing(id) {
            let now = Instant::now();
            let due = self
                .last_repair
                .get(&id)
                .is_none_or(|last| now.duration_since(*last) >= REPAIR_INTERVAL);
            if due {
                self.last_repair.insert(id, now);
                let request = self.tracker.resync(id);
                self.request(id, request, ResyncReason::Repair, Duration::ZERO);
            }
        }
    }

    /// Applies one event; returns whether the index could not place all of it.
    fn apply(&self, model: &str, member: &Member, worker: WorkerKey, event: &KvEvent) -> bool {
        let outcome = member.feed.apply(worker, event);
        let event_type = match event {
            KvEvent::Stored { .. } => "stored",
            KvEvent::Removed { .. } => "removed",
            KvEvent::Cleared => "cleared",
        };
        self.metrics
            .events_applied
            .with_label_values(&[model, outcome.status().as_str(), event_type])
            .inc();
        outcome.suggests_resync()
    }

    /// Sends `request` to instance `id`'s agent after `delay`, retrying until answered;
    /// supersedes a request in flight.
    fn request(
        &mut self,
        id: u64,
        request: SnapshotRequest,
        reason: ResyncReason,
        delay: Duration,
    ) {
        let Some(member) = self.members.get(&id) else {
            return;
        };
        self.metrics.resync(reason);
        self.generation += 1;
        let generation = self.generation;
        let bus = Arc::clone(&self.bus);
        let permits = Arc::clone(&self.permits);
        let subject = member.snapshot_subject.clone();
        let payload = Bytes::from(request.to_json());
        let timeout = self.settings.resync_timeout;
        let metrics = self.metrics.clone();
        let answers = self.answers.clone();
        let task = tokio::spawn(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let deliver = |part| {
                answers.send(ResyncAnswer {
                    id,
                    generation,
                    part,
                })
            };
            resync(
                &*bus, &permits, &subject, payload, timeout, &metrics, deliver,
            )
            .await;
        });
        let pending = Pending {
            generation,
            task: task.abort_handle(),
        };
        if let Some(previous) = self.pending.insert(id, pending) {
            previous.task.abort();
        }
    }
}

/// Sends one resync request until it is answered (with backoff), handing each part of the
/// answer to `deliver` as it arrives, or why the answer could not be read. An answer cut
/// off after some parts (a timeout, the agent gone) is asked for again from its start.
async fn resync<F, D>(
    bus: &dyn EventBus,
    permits: &Semaphore,
    subject: &str,
    payload: Bytes,
    timeout: Duration,
    metrics: &ControlMetrics,
    deliver: D,
) where
    D: Fn(Result<ReplyPart, ControlError>) -> F,
    F: Future<Output = Result<(), mpsc::error::SendError<ResyncAnswer>>>,
{
    let mut backoff = RETRY_FIRST;
    loop {
        let answer = {
            let _permit = permits.acquire().await;
            receive_reply(bus, subject, payload.clone(), timeout, &deliver).await
        };
        match answer {
            Ok(()) => return,
            Err(error @ (ControlError::Codec(_) | ControlError::Protocol(_))) => {
                let _ = deliver(Err(error)).await;
                return;
            }
            Err(error) => {
                tracing::debug!(%subject, %error, "resync request failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RETRY_MAX);
                metrics.resync(ResyncReason::Retry);
            }
        }
    }
}

/// Sends the request and reads its reply, each part within `timeout` of the one before,
/// handing each part to `deliver` before the next is read (the intake applies it meanwhile:
/// a large snapshot is never held whole).
async fn receive_reply<F, D>(
    bus: &dyn EventBus,
    subject: &str,
    payload: Bytes,
    timeout: Duration,
    deliver: &D,
) -> Result<(), ControlError>
where
    D: Fn(Result<ReplyPart, ControlError>) -> F,
    F: Future<Output = Result<(), mpsc::error::SendError<ResyncAnswer>>>,
{
    let mut replies = bus.request_replies(subject, payload).await?;
    let mut assembler = ReplyAssembler::new();
    loop {
        let message = match tokio::time::timeout(timeout, replies.next()).await {
            Ok(Some(message)) => message,
            Ok(None) => return Err(ControlError::NoResponders(subject.to_owned())),
            Err(_) => return Err(ControlError::Timeout("resync request")),
        };
        let part = assembler.next_part(&message.payload)?;
        let last = part.is_last();
        if deliver(Ok(part)).await.is_err() || last {
            // Delivered whole, or the intake is gone.
            return Ok(());
        }
    }
}

/// Forgets what instance `id` (which left) caches in `feed`'s index: lookups stop seeing it
/// at once; freeing its blocks scans the whole index (about 5 ms per million blocks, half a
/// second at 100 M), so it runs on the blocking pool, not on the runtime thread this task
/// shares with requests.
fn clear_off_runtime(feed: &Arc<EventFeed>, id: u64) {
    let detached = feed.detach_instance(id);
    if detached.is_empty() {
        return;
    }
    let feed = Arc::clone(feed);
    tokio::task::spawn_blocking(move || feed.release_detached(detached));
}

/// Forgets what instance `id` caches in `feed`'s index before its snapshot is applied (a
/// resync): its blocks must be gone first, or the snapshot's would be stored beside a
/// retired owner's and keep their counts outside the block (about 12 bytes more each). The scan
/// blocks this task; on a multi-threaded runtime its thread's other tasks move to another
/// thread meanwhile (`block_in_place`).
fn clear_before_snapshot(feed: &EventFeed, id: u64) {
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        tokio::task::block_in_place(|| feed.clear_instance(id));
    } else {
        feed.clear_instance(id);
    }
}

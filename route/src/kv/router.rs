//! [`KvRouter`]: one model's KV-aware routing state and the decision itself.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvmesh_config::KvRoutingConfig;
use kvmesh_kv::{ApproxConfig, ApproxConfigError, BlockHashes, OverlapScores, SequenceHash};
use kvmesh_preprocess::ModelPreprocessor;
use rand::Rng;
use tokio::sync::mpsc;

use crate::candidates::{Candidate, CandidateSet};
use crate::kv::admission::{Admission, Rejected};
use crate::kv::asks::{Asks, RemoteBookings, Steer};
use crate::kv::block_size::{BlockSizeFit, ModelBlockSize};
use crate::kv::booking::{AnswerCheck, Booking};
use crate::kv::busy::BusyThresholds;
use crate::kv::cache_check::{Expectation, SETTLE_GRACE};
use crate::kv::cost::{CandidateLoad, Cost, CostModel, EngineProfile, RequestShape};
use crate::kv::decision::{Choice, Decision, KvRequest, SharedDecision};
use crate::kv::event_feed::{EventFed, EventFeed};
use crate::kv::explain::{
    DECISION_TARGET, Explanation, InstanceExplanation, LoggedCandidate, decision_candidates,
};
use crate::kv::load::{ActiveLoads, LoadSnapshot, NewRequest, ReportedLoad};
use crate::kv::overlap::{
    Approximate, LowerTierBlocks, OverlapSource, TierWeights, cached_depth, deepest_rank,
    instance_depth, lower_tier_blocks, worker_key,
};
use crate::kv::prediction::record_prediction;
use crate::kv::replicas::{OwnLoads, ReplicaLoads, ReplicaShare};
use crate::kv::select::{Scored, TIE_EPSILON, probabilities, select};
use crate::kv::sessions::{SessionBinding, Sessions};
use crate::kv::tokenizer_check::{TokenizerChecks, TokenizerOutcome};
use crate::metrics::{KvMetrics, RouteStage};
use crate::prepare::{Prepared, Preparer, PromptBlocks, RouteInput, StageTimes};

/// Longest pause between two sweeps of stale loads and expired predictions.
const MAX_SWEEP_INTERVAL: Duration = Duration::from_secs(30);
/// Shortest pause between two sweeps.
const MIN_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// One instance evaluated for a request.
#[derive(Debug, Clone, Copy)]
struct Evaluated {
    eligible: bool,
    busy: bool,
    overlap_blocks: u32,
    lower_tier: LowerTierBlocks,
    load: LoadSnapshot,
    cost: Cost,
    in_flight: u64,
}

/// The eligible candidates of one request, scored ([`KvRouter::open`]).
struct Open {
    /// The ones not busy: (index among the candidates, evaluation).
    open: Vec<(usize, Evaluated)>,
    /// How many were eligible, busy or not.
    eligible: usize,
    /// The least prefill backlog among the eligible ones.
    least_backlog: u64,
}

/// The KV-aware router of one model.
#[derive(Debug)]
pub struct KvRouter {
    preparer: Preparer,
    /// Tokens per block: `kv.block_size`, or the first instance record's; and the instances
    /// whose engines run another size.
    block_size: ModelBlockSize,
    /// Whether each instance's engine tokenizes as the proxy does.
    tokenizer_checks: TokenizerChecks,
    /// The cost's weights and profile (its block size is [`Self::block_size`]'s).
    cost: CostModel,
    /// What a block in host memory or on disk is worth against one in device memory.
    tier_weights: TierWeights,
    temperature: f64,
    busy: BusyThresholds,
    overlap: Arc<dyn OverlapSource>,
    /// The event-fed index (`None`: no KV events, predictions only).
    events: Option<Arc<EventFeed>>,
    loads: ActiveLoads,
    admission: Admission,
    stale_after: Duration,
    /// Book a stream's output blocks as it generates them (`kv.track_output_blocks`).
    track_output_blocks: bool,
    /// KV capacity of an instance when its record does not say (`kv.total_kv_blocks`).
    total_kv_blocks: Option<u64>,
    /// Session bindings (`None`: `kv.session_header` is empty).
    sessions: Option<Sessions>,
    /// Other proxy replicas' in-flight load.
    replicas: ReplicaLoads,
    /// Where routing decisions go to be shared with the other replicas, once sharing starts.
    decisions: OnceLock<mpsc::UnboundedSender<SharedDecision>>,
    /// Longest wait for the model's decider (`kv.decider_timeout`; 0: never asked).
    decider_timeout: Duration,
    /// A fingerprint of the model's `kv` settings: a decider routes only for replicas whose
    /// settings are its own.
    settings: u64,
    /// Asks of the model's decider (another replica).
    asks: Asks,
    /// Bookings made as the model's decider for other replicas' requests.
    remote: RemoteBookings,
    metrics: KvMetrics,
}

impl KvRouter {
    /// A router with `config` and no instance yet ([`KvRouter::add_instance`]); `tokenizer`
    /// prepares chat and text prompts. Predictions start empty (approximate mode); with
    /// `kv_events`, an event-fed index takes over while events flow ([`EventFeed`]).
    pub fn new(
        config: &KvRoutingConfig,
        tokenizer: Option<Arc<ModelPreprocessor>>,
        forward_token_ids: bool,
        kv_events: bool,
        metrics: KvMetrics,
    ) -> Result<Self, ApproxConfigError> {
        let limits = ApproxConfig {
            ttl: config.approx_ttl,
            max_blocks: config.approx_max_blocks,
            prune_target_ratio: config.approx_prune_ratio,
        };
        let events = if kv_events {
            Some(Arc::new(EventFeed::new(
                config.index_max_blocks,
                limits,
                &config.cache_check,
            )?))
        } else {
            None
        };
        let overlap: Arc<dyn OverlapSource> = match &events {
            Some(feed) => Arc::new(EventFed::new(Arc::clone(feed))),
            None => Arc::new(Approximate::new(limits)?),
        };
        let block_size = ModelBlockSize::new(config.block_size);
        Ok(Self {
            preparer: Preparer::with_shared_block_size(
                tokenizer,
                block_size.shared(),
                forward_token_ids,
            ),
            cost: CostModel {
                block_size: block_size.get(),
                overlap_weight: config.overlap_weight,
                harm_weight: config.harm_weight,
                queue_weight: config.queue_weight,
                work_weight: config.work_weight,
                overlap_credit_decay: config.overlap_credit_decay,
                profile: EngineProfile::DEFAULT,
                token_factor: 1.0,
            },
            tier_weights: TierWeights {
                host: config.tier_weights.host,
                disk: config.tier_weights.disk,
            },
            temperature: config.temperature,
            busy: BusyThresholds::from_config(config),
            overlap,
            events,
            loads: ActiveLoads::new(),
            admission: Admission::new(
                config.queue.max_size,
                config.queue.timeout,
                metrics.queue_depth.clone(),
            ),
            stale_after: config.stale_request_timeout,
            track_output_blocks: config.track_output_blocks,
            total_kv_blocks: config.total_kv_blocks.filter(|&total| total > 0),
            sessions: (!config.session_header.is_empty())
                .then(|| Sessions::new(&config.session_header, config.session_ttl)),
            replicas: ReplicaLoads::default(),
            decisions: OnceLock::new(),
            decider_timeout: config.decider_timeout,
            settings: xxhash_rust::xxh3::xxh3_64(format!("{config:?}").as_bytes()),
            asks: Asks::default(),
            remote: RemoteBookings::default(),
            block_size,
            tokenizer_checks: TokenizerChecks::new(config.tokenizer_check.clone()),
            metrics,
        })
    }

    /// Asks of the model's decider.
    pub(super) fn asks(&self) -> &Asks {
        &self.asks
    }

    /// Bookings made as the model's decider.
    pub(super) fn remote(&self) -> &RemoteBookings {
        &self.remote
    }

    /// The other replicas' shared load (and so which replicas are live).
    pub(super) fn replica_loads(&self) -> &ReplicaLoads {
        &self.replicas
    }

    /// The model's metric handles.
    pub(super) fn metrics(&self) -> &KvMetrics {
        &self.metrics
    }

    /// `kv.decider_timeout`.
    pub(super) fn decider_timeout(&self) -> Duration {
        self.decider_timeout
    }

    /// A fingerprint of the model's `kv` settings (equal settings, equal fingerprints, within
    /// one kvmesh version).
    pub(super) fn settings(&self) -> u64 {
        self.settings
    }

    /// Releases bookings (instance, booking id), waking the admission queue.
    pub(super) fn release_all(&self, bookings: &[(u64, u64)]) {
        let mut released = false;
        for &(instance, id) in bookings {
            released |= self.loads.release(instance, id);
        }
        if released {
            self.admission.wake();
        }
    }

    /// The cost model with the block size and the token factor in force.
    #[inline]
    fn cost_model(&self) -> CostModel {
        CostModel {
            block_size: self.block_size(),
            token_factor: self.loads.token_factor(),
            ..self.cost
        }
    }

    /// Instance `instance`'s engine runs KV blocks of `engine` tokens (from its instance
    /// record; 0: unknown). While the model has no block size (`kv.block_size` unset, no
    /// registered instance yet) it takes this one; an engine of another size is a conflict:
    /// its KV events are not indexed (they could never match), it is scored by the proxy's
    /// predictions alone, and its KV capacity is converted into the model's blocks.
    pub fn fit_block_size(&self, instance: u64, engine: u64) -> BlockSizeFit {
        let fit = self.block_size.fit(instance, engine);
        if let Some(feed) = &self.events {
            let differs = matches!(fit, BlockSizeFit::Differs { .. });
            feed.set_approximate_only(
                instance,
                differs || self.tokenizer_checks.is_mismatched(instance),
            );
        }
        fit
    }

    /// The tokenizer checks of the model's instances ([`crate::kv::tokenizer_check`]).
    pub fn tokenizer_checks(&self) -> &TokenizerChecks {
        &self.tokenizer_checks
    }

    /// Records how instance `instance`'s engine tokenizes compared with the proxy, and counts
    /// it. An engine that tokenizes otherwise caches blocks the proxy's hashes can never
    /// match: its KV events are not indexed and it is scored by predictions alone, as for a
    /// block-size conflict.
    pub fn record_tokenizer_check(&self, instance: u64, outcome: TokenizerOutcome) {
        self.metrics.count_tokenizer_check(&outcome);
        let mismatched = matches!(outcome, TokenizerOutcome::Mismatched(_));
        self.tokenizer_checks.record(instance, outcome);
        if let Some(feed) = &self.events {
            feed.set_approximate_only(
                instance,
                mismatched || self.block_size.conflict(instance).is_some(),
            );
        }
    }

    /// No instance registered for the model is left: unless `kv.block_size` is set, the next
    /// instance record sets the block size again. Returns whether it was unset.
    pub fn reset_block_size(&self) -> bool {
        self.block_size.reset()
    }

    /// The block size of instance `instance`'s engine when it differs from the model's (the
    /// instance is then scored by predictions alone).
    pub fn block_size_conflict(&self, instance: u64) -> Option<u64> {
        self.block_size.conflict(instance)
    }

    /// Whether instance `instance`'s agent lost KV events its engine could not replay (it is
    /// then scored by predictions alone).
    pub fn events_incomplete(&self, instance: u64) -> bool {
        self.events
            .as_deref()
            .is_some_and(|feed| feed.is_events_incomplete(instance))
    }

    /// Every instance whose engine runs another block size than the model, with that size,
    /// by id.
    pub fn block_size_conflicts(&self) -> Vec<(u64, u64)> {
        self.block_size.conflicts()
    }

    /// Starts accounting load for instance `instance` (it joined the pool).
    pub fn add_instance(&self, instance: u64) {
        self.loads.add(instance);
    }

    /// Instance `instance`'s engine holds `total_blocks` KV blocks (0: unknown, then
    /// `kv.total_kv_blocks`) over `dp_ranks` data-parallel ranks: its busy threshold and its
    /// decode cost are measured against it, and a bounded index (`kv.index_max_blocks`)
    /// evicts first from ranks holding more than their share. An engine whose block size
    /// differs from the model's has its capacity converted into the model's blocks.
    pub fn set_capacity(&self, instance: u64, total_blocks: u64, dp_ranks: u32) {
        let total_blocks = match self.block_size.conflict(instance) {
            Some(engine) => {
                let tokens = u128::from(total_blocks) * u128::from(engine);
                u64::try_from(tokens / u128::from(self.block_size().max(1))).unwrap_or(u64::MAX)
            }
            None => total_blocks,
        };
        self.loads.set_capacity(instance, total_blocks);
        if let Some(feed) = &self.events {
            feed.set_capacity(instance, total_blocks, dp_ranks);
        }
        self.admission.wake();
    }

    /// The KV capacity to measure an instance by: its engine's (`reported`, 0: unknown),
    /// else `kv.total_kv_blocks`, else 0.
    fn capacity(&self, reported: u64) -> u64 {
        Some(reported)
            .filter(|&total| total > 0)
            .or(self.total_kv_blocks)
            .unwrap_or(0)
    }

    /// Forgets instance `instance` (it left the pool): its load and its cached blocks. Its
    /// in-flight requests finish; their late releases are no-ops.
    pub fn remove_instance(&self, instance: u64) {
        self.loads.remove(instance);
        self.overlap.remove_instance(instance);
        self.block_size.forget(instance);
        self.tokenizer_checks.forget(instance);
        if let Some(feed) = &self.events {
            feed.set_approximate_only(instance, false);
            feed.forget_check(instance);
        }
        if let Some(sessions) = &self.sessions {
            sessions.remove_instance(instance);
        }
        self.admission.wake();
    }

    /// Instance `instance`'s load (the prefix depth measured against `query`) with what the
    /// proxy does not book itself added: the other proxy replicas' shared load, and the
    /// engine's foreign load (what its report holds beyond this proxy's and the replicas'
    /// requests): its blocks to the active blocks, and one block of prefill tokens and one
    /// queued request per request waiting. Its speed is learned from every replica's first
    /// tokens.
    fn folded(&self, instance: u64, query: &[SequenceHash]) -> LoadSnapshot {
        let replicas = self.replicas.on(instance);
        let mut load =
            self.loads
                .snapshot_with(instance, query, replicas.speed, self.replicas.fleet_speed());
        let added_prefill = replicas
            .prefill_tokens
            .saturating_add(load.foreign_waiting.saturating_mul(self.block_size()));
        load.prefill_tokens = load.prefill_tokens.saturating_add(added_prefill);
        load.booked_prefill_tokens = load.booked_prefill_tokens.saturating_add(added_prefill);
        load.requests = load.requests.saturating_add(replicas.requests as usize);
        load.prefill_requests = load
            .prefill_requests
            .saturating_add(replicas.prefill_requests as usize)
            .saturating_add(load.foreign_waiting as usize);
        load.blocks = load
            .blocks
            .saturating_add(replicas.blocks)
            .saturating_add(load.foreign_blocks);
        load
    }

    /// Whether an instance with `load` is over a busy threshold (prefill counted as booked).
    fn is_busy(&self, load: &LoadSnapshot) -> bool {
        self.busy
            .is_busy(load.blocks, load.booked_prefill_tokens, load.capacity)
    }

    /// The proxy's own in-flight load per instance, to share with the other replicas.
    pub fn own_loads(&self) -> OwnLoads {
        self.loads.own()
    }

    /// How many times the proxy's own load went down so far ([`OwnLoads::eased`]).
    pub(super) fn own_eased(&self) -> u64 {
        self.loads.eased()
    }

    /// From now on, every routing decision with a prompt goes to the returned receiver, to be
    /// shared with the other replicas; `None` when it already does.
    pub fn share_decisions(&self) -> Option<mpsc::UnboundedReceiver<SharedDecision>> {
        let (decisions, shared) = mpsc::unbounded_channel();
        self.decisions.set(decisions).ok()?;
        Some(shared)
    }

    /// Takes in a decision another replica made: `hashes` went to instance `instance`. It
    /// counts as this proxy's own would (the side index beside the KV events, and the
    /// predictions), so a burst sharing a prefix split between replicas still co-locates.
    pub fn apply_decision(&self, instance: u64, hashes: &BlockHashes) {
        let pruned = self
            .overlap
            .record(worker_key(instance, None), hashes, Instant::now());
        self.metrics.index_prunes.inc_by(pruned);
    }

    /// Completes when this proxy's own in-flight load changed (a booking, a first token or
    /// a release) since the last wait: the cue to share it with the other replicas.
    pub async fn own_loads_changed(&self) {
        self.loads.changed().await;
    }

    /// Drops the other replicas' shares that expired (replicas that stopped sharing), and
    /// what this replica booked as decider for asks never settled.
    pub fn expire_replica_loads(&self) {
        let now = Instant::now();
        self.replicas.expire(now);
        self.loads
            .set_replicas_token_cost(self.replicas.token_cost());
        self.expire_remote(now);
    }

    /// Takes in replica `replica`'s `share` of its in-flight load per instance (the asks
    /// of the decider it settled: what this replica booked for them as decider goes);
    /// returns whether it was taken (not older than its last one).
    pub fn apply_replica_loads(&self, replica: u64, share: ReplicaShare) -> bool {
        let decided = share.decided;
        let now = Instant::now();
        let Some(freed) = self.replicas.apply(replica, share, now) else {
            return false;
        };
        self.loads
            .set_replicas_token_cost(self.replicas.token_cost());
        for (instance, blocks) in freed {
            self.loads.replica_released(instance, blocks, now);
        }
        self.settle_remote(replica, decided);
        true
    }

    /// Records instance `instance`'s load report, scraped `age` before now: `waiting` queued
    /// requests and `kv_usage` (0 to 1) of its KV capacity in use ([`Self::set_capacity`]),
    /// counting for `ttl`.
    pub fn report_load(
        &self,
        instance: u64,
        waiting: u64,
        kv_usage: f64,
        age: Duration,
        ttl: Duration,
    ) {
        let total = self.capacity(self.loads.capacity(instance));
        let usage = if kv_usage.is_finite() {
            kv_usage.clamp(0.0, 1.0)
        } else {
            0.0
        };
        self.loads.report(
            instance,
            ReportedLoad {
                blocks: (usage * total as f64).round() as u64,
                waiting,
                age,
                until: Instant::now() + ttl,
                replica_blocks: self.replicas.on(instance).blocks,
            },
        );
    }

    /// From now on, the session bindings this router makes go to the returned receiver, to
    /// be shared with the other proxy replicas; `None` without session affinity, or when
    /// they already are shared.
    pub fn share_sessions(&self) -> Option<mpsc::UnboundedReceiver<SessionBinding>> {
        self.sessions.as_ref()?.share()
    }

    /// Takes in a session binding another proxy replica made (ignored without session
    /// affinity).
    pub fn apply_session(&self, binding: SessionBinding) {
        if let Some(sessions) = &self.sessions {
            sessions.apply(binding, Instant::now());
        }
    }

    /// The request header naming a request's session (`None`: no session affinity).
    pub fn session_header(&self) -> Option<&str> {
        self.sessions.as_ref().map(Sessions::header)
    }

    /// The event-fed index, when KV events feed this model.
    pub fn event_feed(&self) -> Option<&Arc<EventFeed>> {
        self.events.as_ref()
    }

    /// Tokens per block now: `kv.block_size`, else the first instance record's, else 16.
    #[inline]
    pub fn block_size(&self) -> u64 {
        self.block_size.get()
    }

    /// How requests are turned into blocks.
    pub fn preparer(&self) -> &Preparer {
        &self.preparer
    }

    /// Looks a prepared request up in the index, recording the stage timings and fallbacks.
    pub fn request(&self, prepared: &Prepared, now: Instant) -> KvRequest {
        let times = prepared.times;
        for (stage, time) in [
            (RouteStage::Template, times.template),
            (RouteStage::Tokenize, times.tokenize),
            (RouteStage::Hash, times.hash),
        ] {
            if let Some(time) = time {
                self.metrics.observe_stage(stage, time);
            }
        }
        let start = Instant::now();
        let request = self.lookup(prepared, now);
        match &request.input {
            RouteInput::Tokens(_) => self
                .metrics
                .observe_stage(RouteStage::Lookup, start.elapsed()),
            RouteInput::Fallback(reason) => self.metrics.count_fallback(*reason),
        }
        request
    }

    /// Looks up another replica's prompt (nothing recorded).
    pub(super) fn lookup_prompt(&self, prompt: Arc<PromptBlocks>, now: Instant) -> KvRequest {
        let prepared = Prepared {
            input: RouteInput::Tokens(prompt),
            times: StageTimes::default(),
            rewritten: None,
        };
        self.lookup(&prepared, now)
    }

    /// Looks a prepared request up in the index (nothing recorded).
    pub fn lookup(&self, prepared: &Prepared, now: Instant) -> KvRequest {
        match &prepared.input {
            RouteInput::Tokens(prompt) => {
                let (scores, reported) = self
                    .overlap
                    .find_matches_reported(&prompt.hashes.sequence, now);
                KvRequest {
                    input: prepared.input.clone(),
                    shape: RequestShape::new(prompt.tokens as u64, prompt.block_size as u64),
                    scores,
                    reported,
                    session: None,
                }
            }
            RouteInput::Fallback(_) => KvRequest {
                input: prepared.input.clone(),
                shape: RequestShape::default(),
                scores: OverlapScores::default(),
                reported: None,
                session: None,
            },
        }
    }

    /// Instance `id`'s load with the foreign part folded in; the prefix depth is measured
    /// against `request`'s prompt.
    fn load_of(&self, id: u64, request: &KvRequest) -> LoadSnapshot {
        let query = match &request.input {
            RouteInput::Tokens(prompt) => &prompt.hashes.sequence[..],
            RouteInput::Fallback(_) => &[],
        };
        self.folded(id, query)
    }

    /// Instance `id` (with `in_flight` requests and `load`) scored for `request`, when the
    /// least-loaded candidate has `least_backlog` prefill tokens queued.
    fn evaluate(
        &self,
        id: u64,
        in_flight: u64,
        load: LoadSnapshot,
        least_backlog: u64,
        request: &KvRequest,
        eligible: bool,
    ) -> Evaluated {
        let overlap_blocks = instance_depth(&request.scores, id);
        let lower_tier = lower_tier_blocks(&request.scores, id, self.tier_weights);
        let cost = self.cost_model().cost(
            &request.shape,
            &CandidateLoad {
                overlap_blocks,
                lower_tier_blocks: lower_tier.weighted(self.tier_weights),
                active_prefill_tokens: load.prefill_tokens,
                active_blocks: load.blocks,
                active_prefix_blocks: load.prefix_blocks,
                requests: load.requests as u64,
                queued_requests: load.prefill_requests as u64,
                total_blocks: self.capacity(load.capacity),
                speed: load.speed,
                credit: self.cost.credit(load.prefill_tokens, least_backlog),
            },
        );
        Evaluated {
            eligible,
            busy: self.is_busy(&load),
            overlap_blocks: overlap_blocks.min(request.shape.full_blocks),
            lower_tier,
            load,
            cost,
            in_flight,
        }
    }

    /// The eligible instances of `candidates` scored for `request`, the busy ones left out.
    fn open<S: CandidateSet + ?Sized>(&self, candidates: &S, request: &KvRequest) -> Open {
        let mut loads: Vec<(usize, LoadSnapshot)> = Vec::with_capacity(candidates.len());
        for index in 0..candidates.len() {
            if candidates.is_eligible(index) {
                loads.push((index, self.load_of(candidates.id(index), request)));
            }
        }
        let eligible = loads.len();
        let least_backlog = least_backlog(loads.iter().map(|(_, load)| load));
        let open = loads
            .into_iter()
            .map(|(index, load)| {
                let evaluated = self.evaluate(
                    candidates.id(index),
                    candidates.in_flight(index),
                    load,
                    least_backlog,
                    request,
                    true,
                );
                (index, evaluated)
            })
            .filter(|(_, evaluated)| !evaluated.busy)
            .collect();
        Open {
            open,
            eligible,
            least_backlog,
        }
    }

    /// Chooses an eligible instance of `candidates` for `request`; busy instances are left
    /// out.
    pub fn choose<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        request: &KvRequest,
        rng: &mut impl Rng,
    ) -> Choice {
        self.choose_steered(candidates, request, None, rng)
    }

    /// [`Self::choose`], but the instance `steer` names (the model's decider chose it) when
    /// it is an eligible candidate that is not busy here.
    pub fn choose_steered<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        request: &KvRequest,
        steer: Option<Steer>,
        rng: &mut impl Rng,
    ) -> Choice {
        let start = Instant::now();
        let Open {
            open,
            eligible,
            least_backlog: _,
        } = self.open(candidates, request);
        let scored: Vec<Scored> = open
            .iter()
            .map(|(_, e)| Scored {
                cost: e.cost.value,
                in_flight: e.in_flight,
            })
            .collect();
        let bound = self.bound_instance(request);
        let affine = bound.and_then(|id| {
            open.iter()
                .position(|&(index, _)| candidates.id(index) == id)
        });
        let steered = steer.and_then(|steer| {
            open.iter()
                .position(|&(index, _)| candidates.id(index) == steer.instance)
        });
        let chosen = steered
            .or(affine)
            .or_else(|| select(&scored, self.temperature, rng));
        let choice = match chosen {
            Some(at) => {
                let (index, evaluated) = open[at];
                let instance_id = candidates.id(index);
                Choice::Picked(Decision {
                    index,
                    instance_id,
                    overlap_blocks: evaluated.overlap_blocks,
                    cost: evaluated.cost,
                    // A steered choice followed a binding only if the decider says so: its
                    // binding for this very request may already have reached this replica.
                    affinity: match steer.filter(|_| steered.is_some()) {
                        Some(steer) => steer.session_bound,
                        None => affine == Some(at),
                    },
                    // Only the engines' own reports say which rank holds a prefix.
                    dp_rank: match steer.filter(|_| steered.is_some()) {
                        Some(steer) => steer.dp_rank,
                        None => request
                            .reported
                            .as_ref()
                            .and_then(|reported| deepest_rank(reported, instance_id)),
                    },
                })
            }
            None if eligible > 0 => Choice::AllBusy,
            None => Choice::NoneEligible,
        };
        self.metrics
            .observe_stage(RouteStage::Score, start.elapsed());
        if tracing::enabled!(target: DECISION_TARGET, tracing::Level::DEBUG) {
            let token_factor = self.loads.token_factor();
            log_decision(
                candidates,
                request,
                &open,
                &choice,
                steered.is_some(),
                token_factor,
            );
        }
        choice
    }

    /// Whether this replica's own choice for `request` would stand even if each of `others`
    /// other replicas had just sent a request like it there unseen: the cheapest open
    /// candidate caches more of the prompt than the next cheapest and, with `others` more
    /// requests' new prefill tokens queued on it, still costs less (or the request's session
    /// is bound to an open candidate, or only one candidate is open). A choice that rests on
    /// load or speed alone is never decisive: every replica sees the same idle instance, and
    /// a burst would pile onto it. Under `temperature > 0` nothing is decisive. The decider
    /// would choose the same, so asking it only adds the hop ([`Self::ask_decider`]).
    pub(super) fn decisive<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        request: &KvRequest,
        others: u64,
    ) -> bool {
        if self.temperature > 0.0 {
            return false;
        }
        let Open {
            open,
            least_backlog,
            ..
        } = self.open(candidates, request);
        if self
            .bound_instance(request)
            .is_some_and(|bound| open.iter().any(|&(index, _)| candidates.id(index) == bound))
        {
            return true;
        }
        let Some(&(best_index, best)) = open
            .iter()
            .min_by(|(_, a), (_, b)| a.cost.value.total_cmp(&b.cost.value))
        else {
            return false;
        };
        let Some((_, next)) = open
            .iter()
            .filter(|&&(index, _)| index != best_index)
            .min_by(|(_, a), (_, b)| a.cost.value.total_cmp(&b.cost.value))
        else {
            return true;
        };
        if best.overlap_blocks <= next.overlap_blocks {
            return false;
        }
        // The unseen requests would be prefilled in the same iterations as this one: their
        // new tokens queue ahead of it; they are no running streams yet.
        let mut crowded = best.load;
        crowded.prefill_tokens += others.saturating_mul(best.cost.new_prefill_tokens);
        let best_id = candidates.id(best_index);
        let crowded = self.evaluate(best_id, 0, crowded, least_backlog, request, true);
        crowded.cost.value + TIE_EPSILON < next.cost.value
    }

    /// The instance `request`'s session is bound to now, if any.
    fn bound_instance(&self, request: &KvRequest) -> Option<u64> {
        let sessions = self.sessions.as_ref()?;
        sessions.bound(request.session.as_deref()?, Instant::now())
    }

    /// Whether a request may be routed now: some instance available at `now_ms` is not
    /// busy, or none is available at all (then routing answers "no healthy instance", not
    /// "busy").
    pub fn admissible<C: Candidate>(&self, instances: &[Arc<C>], now_ms: u64) -> bool {
        let mut any_available = false;
        for instance in instances {
            if !instance.is_available(now_ms) {
                continue;
            }
            any_available = true;
            let load = self.folded(instance.id(), &[]);
            if !self.is_busy(&load) {
                return true;
            }
        }
        !any_available
    }

    /// Waits (bounded) until the request is [`admissible`](Self::admissible).
    pub async fn admit<C: Candidate>(
        &self,
        instances: &[Arc<C>],
        now_ms: impl Fn() -> u64,
    ) -> Result<(), Rejected> {
        let admitted = self
            .admission
            .admit(|| self.admissible(instances, now_ms()))
            .await;
        if admitted.is_err() {
            self.metrics.busy_rejections.inc();
        }
        admitted
    }

    /// Counts a request answered 503 because every instance was busy after admission.
    pub fn count_busy_rejection(&self) {
        self.metrics.busy_rejections.inc();
    }

    /// Books `decision` for `request` and records the prediction; the booking releases the
    /// load when dropped. The prediction is recorded before the request is sent (as Dynamo
    /// does, so concurrent requests with the same prefix see it); if the attempt then fails to
    /// connect, it stays until its TTL ends, and the failing instance is ejected or skipped.
    pub fn commit(&self, decision: &Decision, request: &KvRequest, now: Instant) -> Booking<'_> {
        let check = self.answer_check(decision.instance_id, request, now);
        let id = self.book(decision, request, now);
        Booking::new(
            &self.loads,
            &self.admission,
            decision.instance_id,
            id,
            self.block_size(),
            self.track_output_blocks,
        )
        .checked_by(check)
    }

    /// Records `decision`'s prediction (shared with the other replicas), binds its session
    /// and books its load; returns the booking's id (`None`: nothing booked).
    pub(super) fn book(
        &self,
        decision: &Decision,
        request: &KvRequest,
        now: Instant,
    ) -> Option<u64> {
        let prompt = match &request.input {
            RouteInput::Tokens(prompt) => {
                record_prediction(
                    &self.overlap,
                    worker_key(decision.instance_id, decision.dp_rank),
                    prompt,
                    now,
                    &self.metrics.index_prunes,
                );
                if let Some(decisions) = self.decisions.get() {
                    // The receiver lives as long as the proxy.
                    let _ = decisions.send(SharedDecision {
                        instance: decision.instance_id,
                        prompt: Arc::clone(prompt),
                    });
                }
                self.metrics
                    .overlap_blocks
                    .observe(f64::from(decision.overlap_blocks));
                Some(Arc::clone(prompt))
            }
            RouteInput::Fallback(_) => None,
        };
        let booked = NewRequest {
            prompt,
            prefill_tokens: decision.cost.new_prefill_tokens,
            profiled_ttft_ms: decision.cost.profiled_ttft_ms,
            profiled_token_ms: decision.cost.profiled_token_ms,
            profiled_own_ms: decision.cost.profiled_own_ms,
        };
        if let (Some(sessions), Some(session)) = (&self.sessions, &request.session) {
            sessions.bind(session, decision.instance_id, now);
        }
        self.loads.book(decision.instance_id, booked, now)
    }

    /// What the index expects instance `instance`'s answer to `request` to report cached,
    /// judged when it comes ([`crate::kv::cache_check`]); `None` when it is not judged: the
    /// check is off, events do not flow, the request has no tokens, or the instance is
    /// scored approximately. Taken before the request is booked: whether the instance had
    /// other requests in flight decides how much the proxy's own predictions may add.
    fn answer_check(
        &self,
        instance: u64,
        request: &KvRequest,
        now: Instant,
    ) -> Option<AnswerCheck<'_>> {
        let feed = self.events.as_deref().filter(|feed| feed.checks())?;
        let reported = request.reported.as_ref()?;
        let RouteInput::Tokens(prompt) = &request.input else {
            return None;
        };
        if feed.is_approximate_only(instance)
            || feed.is_untrusted(instance)
            || feed.is_events_incomplete(instance)
        {
            return None;
        }
        let block_size = prompt.block_size.max(1);
        let cap = u32::try_from(prompt.tokens.saturating_sub(1) / block_size).unwrap_or(u32::MAX);
        let reported = cached_depth(reported, instance).min(cap);
        let settled = self.replicas.on(instance).requests == 0
            && self.loads.settled(instance, now, SETTLE_GRACE);
        let allowed = if settled {
            reported
        } else {
            cached_depth(&request.scores, instance).min(cap)
        };
        Some(AnswerCheck {
            feed,
            metrics: &self.metrics,
            expected: Expectation {
                reported,
                allowed,
                cap,
                block_size: u32::try_from(block_size).unwrap_or(u32::MAX),
            },
        })
    }

    /// How each instance would be scored for `request` now, and which one would be chosen;
    /// books nothing and records nothing.
    pub fn explain<C: Candidate>(
        &self,
        instances: &[Arc<C>],
        request: &KvRequest,
        now_ms: u64,
        rng: &mut impl Rng,
    ) -> Explanation {
        let loads: Vec<LoadSnapshot> = instances
            .iter()
            .map(|instance| self.load_of(instance.id(), request))
            .collect();
        let least_backlog = least_backlog(
            instances
                .iter()
                .zip(&loads)
                .filter(|(instance, _)| instance.is_available(now_ms))
                .map(|(_, load)| load),
        );
        let evaluated: Vec<Evaluated> = instances
            .iter()
            .zip(loads)
            .map(|(instance, load)| {
                self.evaluate(
                    instance.id(),
                    instance.in_flight(),
                    load,
                    least_backlog,
                    request,
                    instance.is_available(now_ms),
                )
            })
            .collect();
        let open: Vec<usize> = (0..evaluated.len())
            .filter(|&i| evaluated[i].eligible && !evaluated[i].busy)
            .collect();
        let scored: Vec<Scored> = open
            .iter()
            .map(|&i| Scored {
                cost: evaluated[i].cost.value,
                in_flight: evaluated[i].in_flight,
            })
            .collect();
        let mut chance = vec![0.0; evaluated.len()];
        for (&i, p) in open.iter().zip(probabilities(&scored, self.temperature)) {
            chance[i] = p;
        }
        let bound = self.bound_instance(request);
        let affine = bound.and_then(|id| open.iter().position(|&i| instances[i].id() == id));
        let chosen = affine
            .or_else(|| select(&scored, self.temperature, rng))
            .map(|at| open[at]);
        let (prompt_tokens, fallback) = match &request.input {
            RouteInput::Tokens(prompt) => (prompt.tokens, None),
            RouteInput::Fallback(reason) => (0, Some(reason.label())),
        };
        Explanation {
            block_size: self.block_size(),
            overlap_weight: self.cost.overlap_weight,
            harm_weight: self.cost.harm_weight,
            queue_weight: self.cost.queue_weight,
            work_weight: self.cost.work_weight,
            overlap_credit_decay: self.cost.overlap_credit_decay,
            tier_weights: self.tier_weights,
            temperature: self.temperature,
            token_factor: self.loads.token_factor(),
            prompt_tokens,
            prompt_blocks: request.shape.full_blocks,
            fallback,
            chosen: chosen
                .and_then(|i| instances.get(i))
                .map(|i| i.url().to_string()),
            all_busy: open.is_empty() && evaluated.iter().any(|e| e.eligible),
            session_bound_to: bound
                .and_then(|id| instances.iter().find(|i| i.id() == id))
                .map(|i| i.url().to_string()),
            instances: instances
                .iter()
                .zip(&evaluated)
                .zip(chance)
                .map(|((instance, e), probability)| InstanceExplanation {
                    instance: instance.url().to_string(),
                    eligible: e.eligible,
                    busy: e.busy,
                    overlap_blocks: e.overlap_blocks,
                    host_blocks: e.lower_tier.host,
                    disk_blocks: e.lower_tier.disk,
                    reported_blocks: request.reported.as_ref().map(|reported| {
                        instance_depth(reported, instance.id()).min(request.shape.full_blocks)
                    }),
                    active_prefill_tokens: e.load.prefill_tokens,
                    active_blocks: e.load.blocks,
                    active_requests: e.load.requests,
                    queued_requests: e.load.prefill_requests,
                    kv_capacity_blocks: self.capacity(e.load.capacity),
                    in_flight: e.in_flight,
                    prefill_tokens: e.cost.prefill_tokens,
                    decode_blocks: e.cost.decode_blocks,
                    speed: e.load.speed,
                    speed_samples: e.load.speed_samples,
                    predicted_ttft_ms: e.cost.ttft_ms,
                    predicted_itl_ms: e.cost.itl_ms,
                    harm_ms: e.cost.harm_ms,
                    queue_ms: e.cost.queue_ms,
                    work_ms: e.cost.work_ms,
                    cost: e.cost.value,
                    probability,
                    block_size_mismatch: self.block_size.conflict(instance.id()),
                    tokenizer_mismatch: self.tokenizer_checks.mismatch(instance.id()),
                    cache_check: self
                        .events
                        .as_deref()
                        .and_then(|feed| feed.check_state(instance.id())),
                    events_incomplete: self
                        .events
                        .as_deref()
                        .is_some_and(|feed| feed.is_events_incomplete(instance.id())),
                })
                .collect(),
        }
    }

    /// How often the sweeper should run.
    pub fn sweep_interval(&self) -> Duration {
        (self.stale_after / 10).clamp(MIN_SWEEP_INTERVAL, MAX_SWEEP_INTERVAL)
    }

    /// Drops stale bookings and expired predictions at `now`; returns how many bookings.
    pub fn sweep(&self, now: Instant) -> usize {
        self.overlap.expire(now);
        self.replicas.expire(now);
        self.loads
            .set_replicas_token_cost(self.replicas.token_cost());
        if let Some(sessions) = &self.sessions {
            sessions.expire(now);
        }
        let expired = now
            .checked_sub(self.stale_after)
            .map_or(0, |cutoff| self.loads.expire_stale(cutoff));
        if expired > 0 {
            tracing::warn!(expired, "dropped stale requests from the load accounting");
            self.admission.wake();
        }
        expired
    }

    /// Copies the index size of each of `instances` (all its ranks) into
    /// `kvmesh_index_blocks`, and its learned speed into `kvmesh_route_instance_speed`; the
    /// blocks the event-fed index evicted into `kvmesh_index_evicted_blocks`, and its heap
    /// bytes into `kvmesh_index_bytes`; the model's learned token factor into
    /// `kvmesh_route_token_factor`.
    pub fn refresh_gauges<C: Candidate>(&self, instances: &[Arc<C>]) {
        self.metrics.set_token_factor(self.loads.token_factor());
        if let Some(feed) = &self.events {
            let index = feed.index();
            self.metrics
                .set_index_evicted_blocks(index.stats().evicted_blocks);
            self.metrics.set_index_bytes(index.heap_bytes());
        }
        let mut counts: HashMap<u64, u64> = HashMap::with_capacity(instances.len());
        for (worker, blocks) in self.overlap.cached_blocks() {
            *counts.entry(worker.instance_id).or_default() += blocks;
        }
        for instance in instances {
            let blocks = counts.get(&instance.id()).copied().unwrap_or(0);
            self.metrics.set_index_blocks(instance.url(), blocks);
            let speed = self.folded(instance.id(), &[]).speed;
            self.metrics.set_instance_speed(instance.url(), speed);
            let mismatch = self.block_size.conflict(instance.id()).is_some();
            self.metrics
                .set_block_size_mismatch(instance.url(), mismatch);
            self.metrics.set_tokenizer_mismatch(
                instance.url(),
                self.tokenizer_checks.is_mismatched(instance.id()),
            );
            if let Some(feed) = &self.events {
                let id = instance.id();
                self.metrics
                    .set_cache_check_untrusted(instance.url(), feed.is_untrusted(id));
                self.metrics
                    .set_events_incomplete(instance.url(), feed.is_events_incomplete(id));
            }
        }
    }
}

/// The smallest prefill backlog among `loads` (0 for none): what the overlap credit's decay
/// measures excess against.
fn least_backlog<'a>(loads: impl Iterator<Item = &'a LoadSnapshot>) -> u64 {
    loads.map(|load| load.prefill_tokens).min().unwrap_or(0)
}

/// Writes the decision log's line for `request` ([`DECISION_TARGET`], `debug`).
fn log_decision<S: CandidateSet + ?Sized>(
    candidates: &S,
    request: &KvRequest,
    open: &[(usize, Evaluated)],
    choice: &Choice,
    steered: bool,
    token_factor: f64,
) {
    let chosen = match choice {
        Choice::Picked(decision) => candidates.url(decision.index),
        Choice::AllBusy => "(all busy)",
        Choice::NoneEligible => "(none eligible)",
    };
    let affinity = matches!(choice, Choice::Picked(decision) if decision.affinity);
    let scored = decision_candidates(open.iter().map(|(index, e)| LoggedCandidate {
        url: candidates.url(*index),
        overlap_blocks: e.overlap_blocks,
        load: &e.load,
        cost: &e.cost,
    }));
    tracing::debug!(
        target: DECISION_TARGET,
        chosen,
        prompt_tokens = request.shape.tokens,
        prompt_blocks = request.shape.full_blocks,
        token_factor,
        steered,
        affinity,
        candidates = %scored,
        "routing decision"
    );
}

#[cfg(test)]
mod tests;

//! [`KvRouter`]: one model's KV-aware routing state and the decision itself.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_config::KvRoutingConfig;
use kvmesh_kv::{ApproxConfig, ApproxConfigError, OverlapScores};
use kvmesh_preprocess::ModelPreprocessor;
use rand::Rng;

use crate::candidates::{Candidate, CandidateSet};
use crate::kv::admission::{Admission, Rejected};
use crate::kv::booking::Booking;
use crate::kv::busy::BusyThresholds;
use crate::kv::cost::{CandidateLoad, Cost, CostModel, RequestShape};
use crate::kv::decision::{Choice, Decision, KvRequest};
use crate::kv::event_feed::{EventFed, EventFeed};
use crate::kv::explain::{Explanation, InstanceExplanation};
use crate::kv::load::{ActiveLoads, LoadSnapshot, NewRequest, ReportedLoad};
use crate::kv::overlap::{Approximate, OverlapSource, instance_depth, worker_key};
use crate::kv::select::{Scored, probabilities, select};
use crate::metrics::{KvMetrics, RouteStage};
use crate::prepare::{Prepared, Preparer, RouteInput};

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
    load: LoadSnapshot,
    cost: Cost,
    in_flight: u64,
}

/// The KV-aware router of one model.
#[derive(Debug)]
pub struct KvRouter {
    preparer: Preparer,
    cost: CostModel,
    temperature: f64,
    busy: BusyThresholds,
    overlap: Box<dyn OverlapSource>,
    /// The event-fed index (`None`: no KV events, predictions only).
    events: Option<Arc<EventFeed>>,
    loads: ActiveLoads,
    admission: Admission,
    stale_after: Duration,
    /// KV capacity of an instance when its record does not say (`kv.total_kv_blocks`).
    total_kv_blocks: Option<u64>,
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
        let predicted = Approximate::new(ApproxConfig {
            ttl: config.approx_ttl,
            max_blocks: config.approx_max_blocks,
            prune_target_ratio: config.approx_prune_ratio,
        })?;
        let events = kv_events.then(|| Arc::new(EventFeed::default()));
        let overlap: Box<dyn OverlapSource> = match &events {
            Some(feed) => Box::new(EventFed::new(Arc::clone(feed), predicted)),
            None => Box::new(predicted),
        };
        Ok(Self {
            preparer: Preparer::new(tokenizer, config.block_size, forward_token_ids),
            cost: CostModel {
                block_size: config.block_size.max(1) as u64,
                overlap_weight: config.overlap_weight,
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
            total_kv_blocks: config.total_kv_blocks.filter(|&total| total > 0),
            metrics,
        })
    }

    /// Starts accounting load for instance `instance` (it joined the pool).
    pub fn add_instance(&self, instance: u64) {
        self.loads.add(instance);
    }

    /// Forgets instance `instance` (it left the pool): its load and its cached blocks. Its
    /// in-flight requests finish; their late releases are no-ops.
    pub fn remove_instance(&self, instance: u64) {
        self.loads.remove(instance);
        self.overlap.remove_instance(instance);
        self.admission.wake();
    }

    /// `load` with the engine's foreign load (what its report holds beyond the proxy's own
    /// requests) added: its blocks to the active blocks, and one block of prefill tokens per
    /// request waiting.
    fn folded(&self, mut load: LoadSnapshot) -> LoadSnapshot {
        load.blocks = load.blocks.saturating_add(load.foreign_blocks);
        load.prefill_tokens = load
            .prefill_tokens
            .saturating_add(load.foreign_waiting.saturating_mul(self.cost.block_size));
        load
    }

    /// Records instance `instance`'s load report, scraped `age` before now: `waiting` queued
    /// requests and `kv_usage` (0 to 1) of `total_blocks` KV blocks in use (0: unknown, then
    /// `kv.total_kv_blocks`), counting for `ttl`.
    pub fn report_load(
        &self,
        instance: u64,
        waiting: u64,
        kv_usage: f64,
        total_blocks: u64,
        age: Duration,
        ttl: Duration,
    ) {
        let total = Some(total_blocks)
            .filter(|&total| total > 0)
            .or(self.total_kv_blocks)
            .unwrap_or(0);
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
            },
        );
    }

    /// The event-fed index, when KV events feed this model.
    pub fn event_feed(&self) -> Option<&Arc<EventFeed>> {
        self.events.as_ref()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u64 {
        self.cost.block_size
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

    /// Looks a prepared request up in the index (nothing recorded).
    pub fn lookup(&self, prepared: &Prepared, now: Instant) -> KvRequest {
        match &prepared.input {
            RouteInput::Tokens(prompt) => KvRequest {
                input: prepared.input.clone(),
                shape: RequestShape::new(prompt.tokens as u64, self.cost.block_size),
                scores: self.overlap.find_matches(&prompt.hashes.sequence, now),
            },
            RouteInput::Fallback(_) => KvRequest {
                input: prepared.input.clone(),
                shape: RequestShape::default(),
                scores: OverlapScores::default(),
            },
        }
    }

    /// Instance `id` (with `in_flight` requests) scored for `request`.
    fn evaluate(&self, id: u64, in_flight: u64, request: &KvRequest, eligible: bool) -> Evaluated {
        let query = match &request.input {
            RouteInput::Tokens(prompt) => &prompt.hashes.sequence[..],
            RouteInput::Fallback(_) => &[],
        };
        let load = self.folded(self.loads.snapshot(id, query));
        let overlap_blocks = instance_depth(&request.scores, id);
        let cost = self.cost.cost(
            &request.shape,
            &CandidateLoad {
                overlap_blocks,
                active_prefill_tokens: load.prefill_tokens,
                active_blocks: load.blocks,
                active_prefix_blocks: load.prefix_blocks,
            },
        );
        Evaluated {
            eligible,
            busy: self.busy.is_busy(load.blocks, load.prefill_tokens),
            overlap_blocks: overlap_blocks.min(request.shape.full_blocks),
            load,
            cost,
            in_flight,
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
        let start = Instant::now();
        let mut eligible = 0;
        let mut open: Vec<(usize, Evaluated)> = Vec::with_capacity(candidates.len());
        for index in 0..candidates.len() {
            if !candidates.is_eligible(index) {
                continue;
            }
            eligible += 1;
            let evaluated = self.evaluate(
                candidates.id(index),
                candidates.in_flight(index),
                request,
                true,
            );
            if !evaluated.busy {
                open.push((index, evaluated));
            }
        }
        let scored: Vec<Scored> = open
            .iter()
            .map(|(_, e)| Scored {
                cost: e.cost.value,
                in_flight: e.in_flight,
            })
            .collect();
        let choice = match select(&scored, self.temperature, rng) {
            Some(at) => {
                let (index, evaluated) = open[at];
                Choice::Picked(Decision {
                    index,
                    instance_id: candidates.id(index),
                    overlap_blocks: evaluated.overlap_blocks,
                    cost: evaluated.cost,
                })
            }
            None if eligible > 0 => Choice::AllBusy,
            None => Choice::NoneEligible,
        };
        self.metrics
            .observe_stage(RouteStage::Score, start.elapsed());
        choice
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
            let load = self.folded(self.loads.snapshot(instance.id(), &[]));
            if !self.busy.is_busy(load.blocks, load.prefill_tokens) {
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
        let prompt = match &request.input {
            RouteInput::Tokens(prompt) => {
                let pruned =
                    self.overlap
                        .record(worker_key(decision.instance_id), &prompt.hashes, now);
                self.metrics.index_prunes.inc_by(pruned);
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
        };
        let id = self.loads.book(decision.instance_id, booked, now);
        Booking::new(&self.loads, &self.admission, decision.instance_id, id)
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
        let evaluated: Vec<Evaluated> = instances
            .iter()
            .map(|instance| {
                self.evaluate(
                    instance.id(),
                    instance.in_flight(),
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
        let chosen = select(&scored, self.temperature, rng).map(|at| open[at]);
        let (prompt_tokens, fallback) = match &request.input {
            RouteInput::Tokens(prompt) => (prompt.tokens, None),
            RouteInput::Fallback(reason) => (0, Some(reason.label())),
        };
        Explanation {
            block_size: self.cost.block_size,
            overlap_weight: self.cost.overlap_weight,
            temperature: self.temperature,
            prompt_tokens,
            prompt_blocks: request.shape.full_blocks,
            fallback,
            chosen: chosen
                .and_then(|i| instances.get(i))
                .map(|i| i.url().to_string()),
            all_busy: open.is_empty() && evaluated.iter().any(|e| e.eligible),
            instances: instances
                .iter()
                .zip(&evaluated)
                .zip(chance)
                .map(|((instance, e), probability)| InstanceExplanation {
                    instance: instance.url().to_string(),
                    eligible: e.eligible,
                    busy: e.busy,
                    overlap_blocks: e.overlap_blocks,
                    active_prefill_tokens: e.load.prefill_tokens,
                    active_blocks: e.load.blocks,
                    active_requests: e.load.requests,
                    in_flight: e.in_flight,
                    prefill_tokens: e.cost.prefill_tokens,
                    decode_blocks: e.cost.decode_blocks,
                    cost: e.cost.value,
                    probability,
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
    /// `kvmesh_index_blocks`.
    pub fn refresh_gauges<C: Candidate>(&self, instances: &[Arc<C>]) {
        let mut counts: HashMap<u64, u64> = HashMap::with_capacity(instances.len());
        for (worker, blocks) in self.overlap.cached_blocks() {
            *counts.entry(worker.instance_id).or_default() += blocks;
        }
        for instance in instances {
            let blocks = counts.get(&instance.id()).copied().unwrap_or(0);
            self.metrics.set_index_blocks(instance.url(), blocks);
        }
    }
}

#[cfg(test)]
mod tests;

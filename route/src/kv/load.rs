//! Load accounting per instance (kv-routing §4), booked by the proxy at decision time:
//!
//! - **Active prefill tokens**: Σ over the instance's requests that have not produced their
//!   first response byte of (prompt tokens − tokens predicted cached at decision time), less
//!   the part of the oldest one's that the engine has prefilled by now: it works on that one
//!   since it was booked or since the instance's last first byte, whichever is later, at the
//!   profiled time of its prefill scaled by the instance's learned speed (Dynamo's prefill
//!   load model decays the oldest active prefill the same way). Without this, a request 90 %
//!   through a 100k-token prefill counted as a whole queue of it.
//! - **Active blocks**: the distinct prompt blocks of its in-flight requests, ref-counted by
//!   sequence hash so a prefix shared by several requests counts once, plus one unshared block
//!   per request for a trailing partial block (or for a request without tokens), plus the
//!   full blocks of output it has streamed so far ([`ActiveLoads::generated`]: a long answer
//!   fills the engine's KV cache as it grows). Held until the request ends or its client
//!   leaves.
//!
//! Beside its own bookings, an instance may carry its engine's **reported** load (a
//! worker-agent's load report, [`ReportedLoad`]): KV blocks in use and queued requests. The
//! proxy's bookings are exact for its own requests, and the other proxy replicas share
//! theirs, so only what a report holds beyond both counts (the **foreign** load: clients
//! that bypass the proxies, the engine's real queue): the report minus the proxy's own load
//! and the replicas' shared blocks when it arrived, minus what the proxy or a replica
//! released after the engine was scraped (a report taken while a request ran never
//! re-counts it once it ended, whichever replica routed it). Scoring adds the foreign load
//! to its own and the replicas' (see [`crate::kv::KvRouter`]) until the report expires.
//!
//! Requests older than `stale_request_timeout` are dropped by [`ActiveLoads::expire_stale`]
//! (a sweeper calls it), so a lost release cannot inflate a load forever.
//!
//! One mutex per instance, held for one short, synchronous map operation at a time (never
//! across an `.await`): a booking or a release touches one instance, scoring reads each
//! candidate once. Instances are keyed by their stable id, so discovery can add and remove
//! them at run time. Time is passed in, so tests control the clock.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvmesh_kv::{KeyedState, SequenceHash};
use tokio::sync::Notify;

use crate::kv::replicas::{OwnLoads, SharedLoad, SharedSpeed};
use crate::kv::speed::LearnedSpeed;
use crate::kv::token_cost::TokenCostSums;
use crate::prepare::PromptBlocks;

/// One instance's current load, as scoring reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LoadSnapshot {
    /// Active prefill tokens, less the oldest request's predicted progress (what scoring
    /// predicts with).
    pub(crate) prefill_tokens: u64,
    /// Active prefill tokens as booked, whole until each request's first byte (what the busy
    /// threshold counts: it changes only with bookings and first bytes, which wake the
    /// admission queue).
    pub(crate) booked_prefill_tokens: u64,
    /// Active blocks (distinct prompt blocks plus per-request partial blocks).
    pub(crate) blocks: u64,
    /// Leading blocks of the queried prompt already among the active blocks.
    pub(crate) prefix_blocks: u32,
    /// Requests booked on the instance.
    pub(crate) requests: usize,
    /// Requests booked on the instance still before their first byte (in prefill, or queued
    /// for it).
    pub(crate) prefill_requests: usize,
    /// Blocks in use at the engine beyond the proxy's own, as it last reported them (0
    /// without a fresh report).
    pub(crate) foreign_blocks: u64,
    /// Requests waiting in the engine's queue beyond the proxy's own, as it last reported
    /// them (0 without a fresh report).
    pub(crate) foreign_waiting: u64,
    /// How much slower than profiled the instance proved to be.
    pub(crate) speed: f64,
    /// The first tokens that was learned from, this replica's and the others' it merged.
    pub(crate) speed_samples: u64,
    /// Its KV cache capacity in blocks, as its engine reported it (0: unknown).
    pub(crate) capacity: u64,
}

impl Default for LoadSnapshot {
    /// No load, and the profiled speed.
    fn default() -> Self {
        Self {
            prefill_tokens: 0,
            booked_prefill_tokens: 0,
            blocks: 0,
            prefix_blocks: 0,
            requests: 0,
            prefill_requests: 0,
            foreign_blocks: 0,
            foreign_waiting: 0,
            speed: 1.0,
            speed_samples: 0,
            capacity: 0,
        }
    }
}

/// An instance's own view of its load (a worker-agent's load report).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReportedLoad {
    /// KV blocks in use (`kv_usage × total blocks`).
    pub(crate) blocks: u64,
    /// Requests waiting in the engine's queue.
    pub(crate) waiting: u64,
    /// How long before its arrival the engine was scraped.
    pub(crate) age: Duration,
    /// When the report stops counting.
    pub(crate) until: Instant,
    /// Blocks the other proxy replicas' requests held there when it arrived, as they shared
    /// them: the report holds them too, and they are counted as the replicas' own.
    pub(crate) replica_blocks: u64,
}

/// What a report holds beyond the proxy's own load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ForeignLoad {
    blocks: u64,
    waiting: u64,
    until: Instant,
}

/// Releases remembered to discount from reports scraped before them.
const RELEASE_MEMORY: Duration = Duration::from_secs(5);

/// Most releases remembered per instance.
const MAX_RELEASES: usize = 1024;

/// A request to book on an instance.
#[derive(Debug, Clone)]
pub(crate) struct NewRequest {
    /// The prompt's blocks (`None`: a request routed without tokens).
    pub(crate) prompt: Option<Arc<PromptBlocks>>,
    /// Prompt tokens the instance has to prefill (not predicted cached).
    pub(crate) prefill_tokens: u64,
    /// Time to first token the cost model's profile predicted there.
    pub(crate) profiled_ttft_ms: f64,
    /// The part of it spent per prefilled token, before the learned token factor
    /// ([`crate::kv::token_cost`]).
    pub(crate) profiled_token_ms: f64,
    /// The part of that time the engine spends on this request's own prefill, as profiled
    /// (0: unknown, then its prefill counts whole until its first byte).
    pub(crate) profiled_own_ms: f64,
}

#[derive(Debug)]
struct ActiveRequest {
    prompt: Option<Arc<PromptBlocks>>,
    /// Prefill tokens still counted (0 once the first response byte arrived).
    prefill_tokens: u64,
    /// Whether the request holds one unshared block (partial tail, or no tokens at all).
    tail_block: bool,
    /// Full blocks of output generated so far.
    output_blocks: u64,
    profiled_ttft_ms: f64,
    profiled_token_ms: f64,
    /// The token factor the profiled times were taken at.
    token_factor: f64,
    profiled_own_ms: f64,
    started: Instant,
    /// This proxy's other requests in flight there when it was booked.
    ahead: usize,
}

impl ActiveRequest {
    fn full_blocks(&self) -> &[SequenceHash] {
        self.prompt
            .as_deref()
            .map_or(&[][..], |prompt| &prompt.hashes.sequence[..])
    }

    /// The blocks `output_tokens` output tokens fill on the engine past the prompt's (its
    /// partial tail block first); 0 for a request without tokens.
    fn engine_output_blocks(&self, output_tokens: u64) -> u64 {
        let Some(prompt) = self.prompt.as_deref().filter(|p| p.block_size > 0) else {
            return 0;
        };
        let block_size = prompt.block_size as u64;
        let tail = prompt.tokens as u64 % block_size;
        (tail + output_tokens).div_ceil(block_size) - u64::from(tail > 0)
    }
}

#[derive(Debug, Default)]
struct InstanceLoad {
    prefill_tokens: u64,
    /// The requests still in prefill, oldest first (booking time, id).
    in_prefill: BTreeSet<(Instant, u64)>,
    /// When the last of its requests produced its first response byte.
    last_prefill_done: Option<Instant>,
    /// Reference counts of the full blocks of in-flight requests.
    blocks: HashMap<SequenceHash, u32, KeyedState>,
    tail_blocks: u64,
    /// Output blocks of in-flight requests.
    output_blocks: u64,
    requests: HashMap<u64, ActiveRequest, KeyedState>,
    foreign: Option<ForeignLoad>,
    /// Recent releases: when, and how many blocks each freed.
    released: VecDeque<(Instant, u64)>,
    /// Recent releases of the other proxy replicas, as their shares showed them: when, and
    /// how many blocks each freed.
    replicas_released: VecDeque<(Instant, u64)>,
    speed: LearnedSpeed,
    /// KV cache capacity in blocks (0: unknown).
    capacity: u64,
}

impl InstanceLoad {
    fn add(&mut self, id: u64, request: ActiveRequest) {
        self.prefill_tokens += request.prefill_tokens;
        if request.prefill_tokens > 0 {
            self.in_prefill.insert((request.started, id));
        }
        self.tail_blocks += u64::from(request.tail_block);
        for &hash in request.full_blocks() {
            *self.blocks.entry(hash).or_insert(0) += 1;
        }
        self.requests.insert(id, request);
    }

    /// Removes request `id`, which streamed `output_tokens` tokens, and remembers the blocks
    /// its engine frees.
    fn remove(&mut self, id: u64, output_tokens: u64) -> bool {
        let Some(request) = self.requests.remove(&id) else {
            return false;
        };
        self.prefill_tokens -= request.prefill_tokens;
        self.in_prefill.remove(&(request.started, id));
        self.tail_blocks -= u64::from(request.tail_block);
        self.output_blocks -= request.output_blocks;
        // The engine frees the blocks its output filled too, booked or not. A load report
        // scraped while it ran holds them: those not booked are foreign in the last one
        // taken, and go from it now; a later report scraped before now discounts them all.
        let output_blocks = request.engine_output_blocks(output_tokens);
        let untracked = output_blocks.saturating_sub(request.output_blocks);
        if let Some(foreign) = &mut self.foreign {
            foreign.blocks = foreign.blocks.saturating_sub(untracked);
        }
        let mut freed = u64::from(request.tail_block) + request.output_blocks.max(output_blocks);
        for hash in request.full_blocks() {
            if let Some(count) = self.blocks.get_mut(hash) {
                *count -= 1;
                if *count == 0 {
                    self.blocks.remove(hash);
                    freed += 1;
                }
            }
        }
        remember(&mut self.released, Instant::now(), freed);
        true
    }

    /// Active prefill tokens at `now` for an instance `speed` times slower than profiled: the
    /// oldest request in prefill counts only what the engine has not prefilled of it yet.
    fn prefill_tokens_at(&self, now: Instant, speed: f64) -> u64 {
        let Some(&(_, id)) = self.in_prefill.first() else {
            return self.prefill_tokens;
        };
        let Some(oldest) = self.requests.get(&id) else {
            return self.prefill_tokens;
        };
        let took_ms = oldest.profiled_own_ms * speed;
        if took_ms.is_nan() || took_ms <= 0.0 {
            return self.prefill_tokens;
        }
        let began = self
            .last_prefill_done
            .map_or(oldest.started, |done| done.max(oldest.started));
        let worked_ms = now.saturating_duration_since(began).as_secs_f64() * 1000.0;
        let done = (oldest.prefill_tokens as f64 * (worked_ms / took_ms).min(1.0)) as u64;
        self.prefill_tokens - done.min(oldest.prefill_tokens)
    }

    /// Blocks the proxy's own requests hold.
    fn own_blocks(&self) -> u64 {
        self.blocks.len() as u64 + self.tail_blocks + self.output_blocks
    }

    /// Takes in `report`, arriving at `now`: keeps what it holds beyond the proxy's own load
    /// and the other replicas' (their requests now, and those any of them released since the
    /// engine was scraped).
    fn take_report(&mut self, report: ReportedLoad, now: Instant) {
        let scraped = now.checked_sub(report.age).unwrap_or(now);
        let since = |releases: &VecDeque<(Instant, u64)>| -> u64 {
            releases
                .iter()
                .filter(|(at, _)| *at >= scraped)
                .map(|(_, freed)| freed)
                .sum()
        };
        let released_since = since(&self.released) + since(&self.replicas_released);
        let own_waiting = self
            .requests
            .values()
            .filter(|request| request.prefill_tokens > 0)
            .count() as u64;
        self.foreign = Some(ForeignLoad {
            blocks: report
                .blocks
                .saturating_sub(self.own_blocks())
                .saturating_sub(report.replica_blocks)
                .saturating_sub(released_since),
            waiting: report.waiting.saturating_sub(own_waiting),
            until: report.until,
        });
    }
}

/// Adds a release of `freed` blocks at `now` to `releases`, dropping those older than
/// [`RELEASE_MEMORY`] and the oldest past [`MAX_RELEASES`].
fn remember(releases: &mut VecDeque<(Instant, u64)>, now: Instant, freed: u64) {
    while releases.len() >= MAX_RELEASES
        || releases
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > RELEASE_MEMORY)
    {
        releases.pop_front();
    }
    releases.push_back((now, freed));
}

/// The in-flight load of every instance of one model, keyed by instance id so instances can
/// come and go without shifting the others. The id → load map is replaced whole (copy on
/// write) when an instance is added or removed, and read without a lock.
#[derive(Debug)]
pub(crate) struct ActiveLoads {
    instances: ArcSwap<HashMap<u64, Arc<Mutex<InstanceLoad>>, KeyedState>>,
    next_id: AtomicU64,
    /// Every instance's speed samples together: the prior of each instance's own.
    fleet_speed: Mutex<LearnedSpeed>,
    /// `fleet_speed`'s logarithm (f64 bits), read without a lock when scoring.
    fleet_ln_factor: AtomicU64,
    /// `fleet_speed`'s samples, read without a lock when scoring.
    fleet_samples: AtomicU64,
    /// The first tokens' token-cost sums: this proxy's own, and the other replicas' as
    /// their last shares summed them.
    token_cost: Mutex<(TokenCostSums, TokenCostSums)>,
    /// The token factor both give (f64 bits), read without a lock when scoring.
    token_factor: AtomicU64,
    /// Woken on every booking, first token and release (the replica sharer waits on it).
    changed: Notify,
    /// How many times the load went down (a prefill ended, a request was released or
    /// expired): asks of the decider carry it, so that it waits for the share showing them.
    eased: AtomicU64,
}

impl ActiveLoads {
    /// Empty loads for no instance.
    pub(crate) fn new() -> Self {
        Self {
            instances: ArcSwap::from_pointee(HashMap::default()),
            next_id: AtomicU64::new(1),
            fleet_speed: Mutex::new(LearnedSpeed::default()),
            fleet_ln_factor: AtomicU64::new(0f64.to_bits()),
            fleet_samples: AtomicU64::new(0),
            token_cost: Mutex::new(Default::default()),
            token_factor: AtomicU64::new(1f64.to_bits()),
            changed: Notify::new(),
            eased: AtomicU64::new(0),
        }
    }

    /// Starts accounting for instance `instance` (no-op when it already is).
    pub(crate) fn add(&self, instance: u64) {
        self.instances.rcu(|current| {
            let mut next = HashMap::clone(current);
            next.entry(instance).or_default();
            next
        });
    }

    /// Stops accounting for instance `instance`; its late releases become no-ops.
    pub(crate) fn remove(&self, instance: u64) {
        self.instances.rcu(|current| {
            let mut next = HashMap::clone(current);
            next.remove(&instance);
            next
        });
    }

    fn cell(&self, instance: u64) -> Option<Arc<Mutex<InstanceLoad>>> {
        self.instances.load().get(&instance).cloned()
    }

    fn lock(cell: &Mutex<InstanceLoad>) -> MutexGuard<'_, InstanceLoad> {
        cell.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Instance `instance`'s load; `prefix_blocks` is measured against `query` (a prompt's
    /// sequence hashes). Active block sets are prefix-closed (a request holding a block holds
    /// every block before it), so the depth is found by bisection. Its speed is learned from
    /// this proxy's samples and `others` (the other replicas'), shrunk toward the fleet's:
    /// this proxy's samples of every instance with `others_fleet` (the other replicas' of
    /// every instance). A replica that learned nothing itself yet thus scores an instance no
    /// replica has samples of as fast as the fleet, not as the profile: against a learned
    /// 2.8 for the other instance, a profiled 1.0 once drew a 1,794-token prompt away from
    /// the engine caching all of it.
    pub(crate) fn snapshot_with(
        &self,
        instance: u64,
        query: &[SequenceHash],
        others: SharedSpeed,
        others_fleet: SharedSpeed,
    ) -> LoadSnapshot {
        self.snapshot_at(instance, query, others, others_fleet, Instant::now())
    }

    /// [`snapshot_with`](Self::snapshot_with) at `now`.
    fn snapshot_at(
        &self,
        instance: u64,
        query: &[SequenceHash],
        others: SharedSpeed,
        others_fleet: SharedSpeed,
        now: Instant,
    ) -> LoadSnapshot {
        let Some(cell) = self.cell(instance) else {
            return LoadSnapshot::default();
        };
        let load = Self::lock(&cell);
        let depth = query.partition_point(|hash| load.blocks.contains_key(hash));
        let (foreign_blocks, foreign_waiting) = match load.foreign {
            Some(foreign) if foreign.until > now => (foreign.blocks, foreign.waiting),
            _ => (0, 0),
        };
        let learned = load.speed.with(others);
        let own_fleet = SharedSpeed {
            ln_factor: f64::from_bits(self.fleet_ln_factor.load(Ordering::Relaxed)),
            ln_variance: 0.0,
            samples: self.fleet_samples.load(Ordering::Relaxed),
        };
        let speed = learned.shrunk_toward(own_fleet.merged(others_fleet).ln_factor);
        LoadSnapshot {
            prefill_tokens: load.prefill_tokens_at(now, speed),
            booked_prefill_tokens: load.prefill_tokens,
            blocks: load.own_blocks(),
            prefix_blocks: u32::try_from(depth).unwrap_or(u32::MAX),
            requests: load.requests.len(),
            prefill_requests: load.in_prefill.len(),
            foreign_blocks,
            foreign_waiting,
            speed,
            speed_samples: learned.shared().samples,
            capacity: load.capacity,
        }
    }

    /// Instance `instance`'s load as this proxy alone knows it (no other replica's speed
    /// samples).
    #[cfg(test)]
    pub(crate) fn snapshot(&self, instance: u64, query: &[SequenceHash]) -> LoadSnapshot {
        self.snapshot_with(
            instance,
            query,
            SharedSpeed::default(),
            SharedSpeed::default(),
        )
    }

    /// Whether instance `instance` has no request of this proxy in flight and none ended
    /// within `grace` before `now` (its engine's KV events have had time to arrive).
    pub(crate) fn settled(&self, instance: u64, now: Instant, grace: Duration) -> bool {
        self.cell(instance).is_some_and(|cell| {
            let load = Self::lock(&cell);
            load.requests.is_empty()
                && load
                    .released
                    .back()
                    .is_none_or(|(at, _)| now.saturating_duration_since(*at) >= grace)
        })
    }

    /// Instance `instance`'s KV cache capacity in blocks (0: unknown).
    pub(crate) fn capacity(&self, instance: u64) -> u64 {
        self.cell(instance)
            .map_or(0, |cell| Self::lock(&cell).capacity)
    }

    /// Instance `instance`'s KV cache holds `blocks` blocks (0: unknown).
    pub(crate) fn set_capacity(&self, instance: u64, blocks: u64) {
        if let Some(cell) = self.cell(instance) {
            Self::lock(&cell).capacity = blocks;
        }
    }

    /// Records instance `instance`'s own report of its load, arriving now (ignored for an
    /// unknown one).
    pub(crate) fn report(&self, instance: u64, report: ReportedLoad) {
        if let Some(cell) = self.cell(instance) {
            Self::lock(&cell).take_report(report, Instant::now());
        }
    }

    /// Another proxy replica's share showed `freed` fewer blocks on instance `instance` than
    /// its last one, at `now`: a report scraped before then holds them, and is not to count
    /// them as foreign once it arrives.
    pub(crate) fn replica_released(&self, instance: u64, freed: u64, now: Instant) {
        if let Some(cell) = self.cell(instance) {
            remember(&mut Self::lock(&cell).replicas_released, now, freed);
        }
    }

    /// Books `request` on instance `instance` at `now`; returns its booking id (`None` for an
    /// unknown instance).
    pub(crate) fn book(&self, instance: u64, request: NewRequest, now: Instant) -> Option<u64> {
        let cell = self.cell(instance)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let tail_block = request.prompt.as_deref().is_none_or(PromptBlocks::has_tail);
        let mut load = Self::lock(&cell);
        let active = ActiveRequest {
            prompt: request.prompt,
            prefill_tokens: request.prefill_tokens,
            tail_block,
            output_blocks: 0,
            profiled_ttft_ms: request.profiled_ttft_ms,
            profiled_token_ms: request.profiled_token_ms,
            token_factor: self.token_factor(),
            profiled_own_ms: request.profiled_own_ms,
            started: now,
            ahead: load.requests.len(),
        };
        load.add(id, active);
        drop(load);
        self.changed.notify_one();
        Some(id)
    }

    /// Completes at the next booking, first token or release (at once if one happened since
    /// the last wait).
    pub(crate) async fn changed(&self) {
        self.changed.notified().await;
    }

    /// The request's first response byte arrived at `now`: its prefill tokens stop counting,
    /// and when that byte carried its `first_token` (a streamed response), the time it took
    /// teaches the instance's speed. Returns whether the load changed.
    pub(crate) fn prefill_done(
        &self,
        instance: u64,
        id: u64,
        now: Instant,
        first_token: bool,
    ) -> bool {
        let Some(cell) = self.cell(instance) else {
            return false;
        };
        let mut load = Self::lock(&cell);
        let Some(request) = load.requests.get_mut(&id) else {
            return false;
        };
        let tokens = std::mem::take(&mut request.prefill_tokens);
        let profiled = std::mem::take(&mut request.profiled_ttft_ms);
        let profiled_token = request.profiled_token_ms;
        let token_factor = request.token_factor;
        let started = request.started;
        let ahead = request.ahead;
        let weight = 1.0 / (1 + ahead) as f64;
        let observed = now.saturating_duration_since(started);
        load.prefill_tokens -= tokens;
        if tokens > 0 {
            load.in_prefill.remove(&(started, id));
            load.last_prefill_done = Some(load.last_prefill_done.map_or(now, |at| at.max(now)));
            self.ease();
        }
        if first_token {
            let observed_ms = observed.as_secs_f64() * 1000.0;
            tracing::debug!(
                instance,
                profiled_ms = profiled,
                profiled_token_ms = profiled_token,
                token_factor,
                observed_ms,
                ahead,
                "first-token time learned from"
            );
            // The fleet first: an instance's first sample is clipped around it.
            let fleet_ln = {
                let mut fleet = self
                    .fleet_speed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                fleet.observe(profiled, observed_ms, weight, None);
                self.fleet_ln_factor
                    .store(fleet.ln_factor().to_bits(), Ordering::Relaxed);
                self.fleet_samples
                    .store(fleet.shared().samples, Ordering::Relaxed);
                fleet.ln_factor()
            };
            load.speed
                .observe(profiled, observed_ms, weight, Some(fleet_ln));
            // Only a request that had the instance to itself (of this proxy's) from its
            // booking to its first token teaches the engine's shape: behind others, or
            // batched with requests booked after it, it teaches the load model's errors.
            let alone = ahead == 0 && load.requests.len() == 1;
            drop(load);
            if alone {
                // The profiled time less its per-token part, as scored: the fixed part.
                let fixed = profiled - token_factor * profiled_token;
                self.learn_token_cost(fixed, profiled_token, observed_ms);
            }
        }
        tokens > 0
    }

    /// The request has generated `blocks` full blocks of output so far (never fewer than
    /// before). Returns whether the load changed.
    pub(crate) fn generated(&self, instance: u64, id: u64, blocks: u64) -> bool {
        let Some(cell) = self.cell(instance) else {
            return false;
        };
        let mut load = Self::lock(&cell);
        let Some(request) = load.requests.get_mut(&id) else {
            return false;
        };
        let added = blocks.saturating_sub(request.output_blocks);
        request.output_blocks += added;
        load.output_blocks += added;
        drop(load);
        if added > 0 {
            self.changed.notify_one();
        }
        added > 0
    }

    /// The request ended (or its client left): all its load is released. Returns whether it
    /// was still booked.
    pub(crate) fn release(&self, instance: u64, id: u64) -> bool {
        self.release_streamed(instance, id, 0)
    }

    /// [`release`](Self::release) of a request that streamed `output_tokens` output tokens:
    /// the blocks they filled on the engine are remembered as freed with the prompt's, so
    /// a load report scraped while it ran does not count them as foreign.
    pub(crate) fn release_streamed(&self, instance: u64, id: u64, output_tokens: u64) -> bool {
        let released = self
            .cell(instance)
            .is_some_and(|cell| Self::lock(&cell).remove(id, output_tokens));
        if released {
            self.ease();
        }
        released
    }

    /// How many times the load went down so far (a prefill ended, a request was released
    /// or expired).
    pub(crate) fn eased(&self) -> u64 {
        self.eased.load(Ordering::Acquire)
    }

    /// The load just went down: counts it (after the change, so a share that reads the
    /// count sees the change) and wakes the sharer.
    fn ease(&self) {
        self.eased.fetch_add(1, Ordering::Release);
        self.changed.notify_one();
    }

    /// The model's learned token factor ([`crate::kv::token_cost`]; 1: as profiled).
    pub(crate) fn token_factor(&self) -> f64 {
        f64::from_bits(self.token_factor.load(Ordering::Relaxed))
    }

    /// The other replicas' token-cost sums changed to `others`.
    pub(crate) fn set_replicas_token_cost(&self, others: TokenCostSums) {
        self.update_token_cost(|(_, theirs)| *theirs = others);
    }

    /// Learns the token factor from one first token (this proxy's).
    fn learn_token_cost(&self, fixed_ms: f64, token_ms: f64, observed_ms: f64) {
        self.update_token_cost(|(own, _)| own.observe(fixed_ms, token_ms, observed_ms));
    }

    /// Changes the token-cost sums (own, the other replicas') with `change`, and the token
    /// factor scoring reads with them.
    fn update_token_cost(&self, change: impl FnOnce(&mut (TokenCostSums, TokenCostSums))) {
        let mut sums = self
            .token_cost
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        change(&mut sums);
        self.token_factor
            .store(sums.0.merged(sums.1).factor().to_bits(), Ordering::Relaxed);
    }

    /// The proxy's own load on every instance, as replicas share it.
    pub(crate) fn own(&self) -> OwnLoads {
        // Read first: the loads read after it show at least that many easings.
        let eased = self.eased();
        let loads = self
            .instances
            .load()
            .iter()
            .map(|(&instance, cell)| {
                let load = Self::lock(cell);
                let shared = SharedLoad {
                    prefill_tokens: load.prefill_tokens,
                    blocks: load.own_blocks(),
                    requests: load.requests.len() as u64,
                    prefill_requests: load.in_prefill.len() as u64,
                    speed: load.speed.shared(),
                };
                (instance, shared)
            })
            .collect();
        let token_cost = self
            .token_cost
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .0;
        OwnLoads {
            eased,
            loads,
            token_cost,
        }
    }

    /// Drops every request booked before `cutoff`; returns how many.
    pub(crate) fn expire_stale(&self, cutoff: Instant) -> usize {
        let mut expired = 0;
        for cell in self.instances.load().values() {
            let mut load = Self::lock(cell);
            let stale: Vec<u64> = load
                .requests
                .iter()
                .filter(|(_, request)| request.started < cutoff)
                .map(|(&id, _)| id)
                .collect();
            for id in stale {
                expired += usize::from(load.remove(id, 0));
            }
        }
        if expired > 0 {
            self.ease();
        }
        expired
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kvmesh_kv::BlockHasher;

    use super::*;

    /// A prompt of `tokens` tokens whose first `shared` tokens are common to every prompt
    /// built with the same `shared`; the rest depends on `seed`.
    fn prompt(tokens: usize, shared: usize, seed: u32) -> Arc<PromptBlocks> {
        let ids: Vec<u32> = (0..tokens as u32)
            .map(|i| {
                if (i as usize) < shared {
                    i
                } else {
                    1_000_000 * seed + i
                }
            })
            .collect();
        Arc::new(PromptBlocks::hash(
            &ids,
            &mut BlockHasher::new(4, None).unwrap(),
        ))
    }

    fn book(loads: &ActiveLoads, instance: u64, prompt: &Arc<PromptBlocks>, prefill: u64) -> u64 {
        let request = NewRequest {
            prompt: Some(Arc::clone(prompt)),
            prefill_tokens: prefill,
            profiled_ttft_ms: 0.0,
            profiled_token_ms: 0.0,
            profiled_own_ms: 0.0,
        };
        loads.book(instance, request, Instant::now()).unwrap()
    }

    /// Loads accounting for instances `0..n`.
    fn loads(n: u64) -> ActiveLoads {
        let loads = ActiveLoads::new();
        for instance in 0..n {
            loads.add(instance);
        }
        loads
    }

    /// Books `prefill` tokens on instance 0 at `at`, whose own prefill is profiled to take
    /// `own_ms`.
    fn book_timed(loads: &ActiveLoads, prefill: u64, own_ms: f64, at: Instant) -> u64 {
        let request = NewRequest {
            prompt: None,
            prefill_tokens: prefill,
            profiled_ttft_ms: own_ms,
            profiled_token_ms: 0.0,
            profiled_own_ms: own_ms,
        };
        loads.book(0, request, at).unwrap()
    }

    fn prefill_at(loads: &ActiveLoads, at: Instant) -> u64 {
        loads
            .snapshot_at(0, &[], SharedSpeed::default(), SharedSpeed::default(), at)
            .prefill_tokens
    }

    #[test]
    fn the_oldest_prefill_counts_only_what_the_engine_has_not_done_yet() {
        let loads = loads(1);
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let first = book_timed(&loads, 1000, 100.0, t0);
        let second = book_timed(&loads, 200, 40.0, ms(10));
        // Only the oldest is being prefilled: a quarter of it is done after 25 ms.
        assert_eq!(prefill_at(&loads, t0), 1200);
        assert_eq!(prefill_at(&loads, ms(25)), 750 + 200);
        // Past its profiled time it counts nothing, though its first byte is not there yet;
        // the second waits behind it, whole. As booked (the busy threshold's count), both
        // count whole until their first bytes.
        assert_eq!(prefill_at(&loads, ms(300)), 200);
        let booked = loads.snapshot_at(
            0,
            &[],
            SharedSpeed::default(),
            SharedSpeed::default(),
            ms(300),
        );
        assert_eq!(booked.booked_prefill_tokens, 1200);
        // The first byte at 120 ms: the second began then, not when it was booked.
        assert!(loads.prefill_done(0, first, ms(120), false));
        assert_eq!(prefill_at(&loads, ms(120)), 200);
        assert_eq!(prefill_at(&loads, ms(130)), 150);
        assert_eq!(prefill_at(&loads, ms(500)), 0);
        assert!(loads.prefill_done(0, second, ms(150), false));
        assert_eq!(prefill_at(&loads, ms(150)), 0);
        // A request booked after that last first byte begins when it is booked; one whose
        // own time is unknown (0) counts whole until its first byte.
        book_timed(&loads, 400, 80.0, ms(1000));
        assert_eq!(prefill_at(&loads, ms(1040)), 200);
        let unknown = ActiveLoads::new();
        unknown.add(0);
        book_timed(&unknown, 400, 0.0, t0);
        assert_eq!(prefill_at(&unknown, ms(10_000)), 400);
    }

    #[test]
    fn a_slower_instance_prefills_its_oldest_request_more_slowly() {
        let loads = loads(1);
        let t0 = Instant::now();
        book_timed(&loads, 1000, 100.0, t0);
        // Twice as slow as profiled, as other replicas have learned it.
        let slow = SharedSpeed {
            ln_factor: 2f64.ln(),
            samples: 1_000_000,
            ..SharedSpeed::default()
        };
        let at = t0 + Duration::from_millis(50);
        assert_eq!(
            loads
                .snapshot_at(0, &[], slow, SharedSpeed::default(), at)
                .prefill_tokens,
            750
        );
        assert_eq!(prefill_at(&loads, at), 500);
    }

    #[test]
    fn prefill_is_released_at_the_first_byte_and_blocks_at_the_end() {
        let loads = loads(2);
        let p = prompt(18, 0, 1); // 4 full blocks + a partial one
        let id = book(&loads, 1, &p, 10);
        let snap = loads.snapshot(1, &p.hashes.sequence);
        assert_eq!(
            snap,
            LoadSnapshot {
                prefill_tokens: 10,
                booked_prefill_tokens: 10,
                blocks: 5,
                prefix_blocks: 4,
                requests: 1,
                prefill_requests: 1,
                ..LoadSnapshot::default()
            }
        );
        assert_eq!(
            loads.snapshot(0, &p.hashes.sequence),
            LoadSnapshot::default()
        );
        assert_eq!(loads.eased(), 0, "a booking adds load");
        assert!(loads.prefill_done(1, id, Instant::now(), false));
        assert!(
            !loads.prefill_done(1, id, Instant::now(), false),
            "only once"
        );
        assert_eq!(loads.own().eased, 1, "the first byte eased the load");
        let snap = loads.snapshot(1, &[]);
        assert_eq!(
            (snap.prefill_tokens, snap.prefill_requests, snap.blocks),
            (0, 0, 5)
        );
        assert!(loads.release(1, id));
        assert!(!loads.release(1, id), "only once");
        assert_eq!(loads.own().eased, 2, "so did the end, once");
        assert_eq!(
            loads.snapshot(1, &p.hashes.sequence),
            LoadSnapshot::default()
        );
    }

    #[test]
    fn output_blocks_count_while_the_request_runs() {
        let loads = loads(1);
        let p = prompt(16, 0, 1); // 4 full blocks, no tail
        let id = book(&loads, 0, &p, 16);
        let other = book(&loads, 0, &prompt(8, 0, 2), 8);
        assert_eq!(loads.snapshot(0, &[]).blocks, 6);
        assert!(loads.generated(0, id, 2));
        assert!(
            !loads.generated(0, id, 2),
            "the same count again changes nothing"
        );
        assert!(!loads.generated(0, id, 1), "never fewer than before");
        assert_eq!(loads.snapshot(0, &[]).blocks, 8);
        assert!(loads.generated(0, id, 3));
        assert_eq!(loads.own().loads[&0].blocks, 9, "replicas see them too");
        assert!(!loads.generated(0, 999, 5), "an unknown booking");
        assert!(loads.release(0, id));
        assert_eq!(
            loads.snapshot(0, &[]).blocks,
            2,
            "the other request's blocks stay"
        );
        assert!(!loads.generated(0, id, 9), "a released booking");
        assert!(loads.release(0, other));
        assert_eq!(loads.snapshot(0, &[]).blocks, 0);
    }

    #[test]
    fn shared_prefixes_count_once_and_stay_until_the_last_holder_ends() {
        let loads = loads(1);
        let a = prompt(16, 12, 1); // blocks: s0 s1 s2 a3
        let b = prompt(20, 12, 2); // blocks: s0 s1 s2 b3 b4
        let id_a = book(&loads, 0, &a, 16);
        let id_b = book(&loads, 0, &b, 8);
        let snap = loads.snapshot(0, &b.hashes.sequence);
        assert_eq!(snap.blocks, 3 + 1 + 2);
        assert_eq!(snap.prefix_blocks, 5);
        assert_eq!(snap.prefill_tokens, 24);
        assert_eq!(snap.requests, 2);
        // A third prompt sharing only the first 12 tokens sees a 3-block active prefix.
        let c = prompt(16, 12, 3);
        assert_eq!(loads.snapshot(0, &c.hashes.sequence).prefix_blocks, 3);
        assert!(loads.release(0, id_a));
        let snap = loads.snapshot(0, &a.hashes.sequence);
        assert_eq!(snap.blocks, 5, "b still holds the shared blocks");
        assert_eq!(snap.prefix_blocks, 3);
        assert!(loads.release(0, id_b));
        assert_eq!(loads.snapshot(0, &b.hashes.sequence).blocks, 0);
    }

    #[test]
    fn requests_without_tokens_hold_one_block() {
        let loads = loads(1);
        let request = NewRequest {
            prompt: None,
            prefill_tokens: 0,
            profiled_ttft_ms: 0.0,
            profiled_token_ms: 0.0,
            profiled_own_ms: 0.0,
        };
        let id = loads.book(0, request, Instant::now()).unwrap();
        assert_eq!(loads.snapshot(0, &[]).blocks, 1);
        assert!(loads.release(0, id));
        assert_eq!(loads.snapshot(0, &[]).blocks, 0);
        let unknown = NewRequest {
            prompt: None,
            prefill_tokens: 0,
            profiled_ttft_ms: 0.0,
            profiled_token_ms: 0.0,
            profiled_own_ms: 0.0,
        };
        assert_eq!(loads.book(5, unknown, Instant::now()), None);
    }

    #[test]
    fn reports_never_recount_the_proxys_own_requests() {
        let loads = loads(1);
        let until = Instant::now() + Duration::from_secs(60);
        let report = |blocks, waiting, age| ReportedLoad {
            blocks,
            waiting,
            age,
            until,
            replica_blocks: 0,
        };
        // Four full blocks of 4 tokens and a tail, its prefill not done yet.
        let held = prompt(4 * 4 + 3, 0, 1);
        let id = book(&loads, 0, &held, 19);
        assert_eq!(loads.snapshot(0, &[]).blocks, 5);
        // A report taken while it runs holds it, and 2 blocks and a queued request of others.
        loads.report(0, report(7, 2, Duration::ZERO));
        let snap = loads.snapshot(0, &[]);
        assert_eq!(
            (snap.blocks, snap.foreign_blocks, snap.foreign_waiting),
            (5, 2, 1)
        );
        // It ends: its blocks go, the others' stay.
        assert!(loads.release(0, id));
        let snap = loads.snapshot(0, &[]);
        assert_eq!((snap.blocks, snap.foreign_blocks), (0, 2));
        // A report scraped while it still ran, arriving after its release: only the others.
        loads.report(0, report(7, 1, Duration::from_secs(1)));
        let snap = loads.snapshot(0, &[]);
        assert_eq!(
            (snap.blocks, snap.foreign_blocks, snap.foreign_waiting),
            (0, 2, 1)
        );
        // A stream that filled 3 blocks of output on the engine (its tail's 3 tokens and 10
        // more: 13 tokens, 4 blocks, one of them the tail), untracked: a report scraped
        // while it ran holds them, and they go with it.
        let loads = self::loads(1);
        let id = book(&loads, 0, &held, 19);
        loads.report(0, report(5 + 3, 0, Duration::ZERO));
        assert_eq!(loads.snapshot(0, &[]).foreign_blocks, 3, "while it runs");
        assert!(loads.release_streamed(0, id, 10));
        assert_eq!(
            loads.snapshot(0, &[]).foreign_blocks,
            0,
            "the report taken then"
        );
        loads.report(0, report(5 + 3, 0, Duration::from_secs(1)));
        assert_eq!(
            loads.snapshot(0, &[]).foreign_blocks,
            0,
            "a report scraped then"
        );
        // Released without its output counted, they would have stayed foreign.
        let loads = self::loads(1);
        let id = book(&loads, 0, &held, 19);
        assert!(loads.release(0, id));
        loads.report(0, report(5 + 3, 0, Duration::from_secs(1)));
        assert_eq!(loads.snapshot(0, &[]).foreign_blocks, 3);
        // With nothing of the proxy's held or released since the scrape, it is all foreign.
        let loads = self::loads(1);
        loads.report(0, report(5, 0, Duration::from_secs(1)));
        assert_eq!(loads.snapshot(0, &[]).foreign_blocks, 5);
    }

    #[test]
    fn reports_count_until_they_expire() {
        let loads = loads(1);
        let now = Instant::now();
        loads.report(
            0,
            ReportedLoad {
                blocks: 30,
                waiting: 2,
                age: Duration::ZERO,
                until: now + Duration::from_secs(60),
                replica_blocks: 0,
            },
        );
        let snap = loads.snapshot(0, &[]);
        assert_eq!((snap.foreign_blocks, snap.foreign_waiting), (30, 2));
        loads.report(
            0,
            ReportedLoad {
                blocks: 30,
                waiting: 2,
                age: Duration::ZERO,
                until: now,
                replica_blocks: 0,
            },
        );
        assert_eq!(loads.snapshot(0, &[]), LoadSnapshot::default());
        loads.report(
            9,
            ReportedLoad {
                blocks: 1,
                waiting: 1,
                age: Duration::ZERO,
                until: now + Duration::from_secs(60),
                replica_blocks: 0,
            },
        );
        assert_eq!(loads.snapshot(9, &[]), LoadSnapshot::default());
    }

    #[test]
    fn removing_an_instance_keeps_the_others_and_voids_its_late_releases() {
        let loads = loads(3);
        let p = prompt(8, 8, 0);
        let on_0 = book(&loads, 0, &p, 8);
        let on_2 = book(&loads, 2, &p, 8);
        loads.remove(0);
        assert_eq!(loads.snapshot(0, &[]), LoadSnapshot::default());
        assert!(!loads.release(0, on_0), "released after removal: a no-op");
        assert_eq!(loads.snapshot(2, &[]).requests, 1, "others keep their load");
        loads.add(7);
        loads.add(2);
        assert_eq!(
            loads.snapshot(2, &[]).requests,
            1,
            "adding again keeps the load"
        );
        assert!(book(&loads, 7, &p, 1) > on_2);
        assert!(loads.release(2, on_2));
    }

    #[test]
    fn stale_requests_expire_on_an_injected_clock() {
        let loads = loads(2);
        let start = Instant::now();
        let p = prompt(8, 8, 0);
        let old = NewRequest {
            prompt: Some(Arc::clone(&p)),
            prefill_tokens: 8,
            profiled_ttft_ms: 0.0,
            profiled_token_ms: 0.0,
            profiled_own_ms: 0.0,
        };
        let old_id = loads.book(0, old, start).unwrap();
        let young = NewRequest {
            prompt: Some(Arc::clone(&p)),
            prefill_tokens: 8,
            profiled_ttft_ms: 0.0,
            profiled_token_ms: 0.0,
            profiled_own_ms: 0.0,
        };
        let young_id = loads
            .book(1, young, start + Duration::from_secs(200))
            .unwrap();
        // At t = 350 s with a 300 s timeout, only the request from t = 0 is stale.
        let now = start + Duration::from_secs(350);
        assert_eq!(loads.expire_stale(now - Duration::from_secs(300)), 1);
        assert_eq!(loads.eased(), 1, "expiring eased the load");
        assert_eq!(loads.expire_stale(now - Duration::from_secs(300)), 0);
        assert_eq!(loads.eased(), 1, "expiring nothing did not");
        assert_eq!(
            loads.snapshot(0, &p.hashes.sequence),
            LoadSnapshot::default()
        );
        assert_eq!(loads.snapshot(1, &p.hashes.sequence).requests, 1);
        assert!(!loads.release(0, old_id), "the late release is a no-op");
        assert!(!loads.prefill_done(0, old_id, now, true));
        assert!(loads.release(1, young_id));
    }

    #[test]
    fn streamed_first_tokens_teach_the_speed_and_other_first_bytes_do_not() {
        let loads = loads(2);
        let start = Instant::now();
        let p = prompt(8, 8, 0);
        let booked = |instance| {
            let request = NewRequest {
                prompt: Some(Arc::clone(&p)),
                prefill_tokens: 8,
                profiled_ttft_ms: 40.0,
                profiled_token_ms: 0.0,
                profiled_own_ms: 40.0,
            };
            loads.book(instance, request, start).unwrap()
        };
        let (streamed, whole) = (booked(0), booked(1));
        let at = start + Duration::from_millis(120);
        assert!(loads.prefill_done(0, streamed, at, true));
        assert!(loads.prefill_done(1, whole, at, false));
        // One sample: both instances lean on the model's factor, 3.
        assert!((loads.snapshot(0, &[]).speed - 3.0).abs() < 1e-9);
        assert!((loads.snapshot(1, &[]).speed - 3.0).abs() < 1e-9);
        // A second first byte teaches nothing more.
        assert!(!loads.prefill_done(0, streamed, at + Duration::from_secs(9), true));
        assert!((loads.snapshot(0, &[]).speed - 3.0).abs() < 1e-9);
        // Instance 1 proves 3× faster than instance 0 over many requests.
        for _ in 0..2000 {
            for (instance, ms) in [(0, 120), (1, 40)] {
                let id = booked(instance);
                loads.prefill_done(instance, id, start + Duration::from_millis(ms), true);
                loads.release(instance, id);
            }
        }
        let ratio = loads.snapshot(0, &[]).speed / loads.snapshot(1, &[]).speed;
        assert!((ratio - 3.0).abs() < 0.1, "{ratio}");
    }

    #[test]
    fn first_tokens_of_prompts_of_different_sizes_teach_the_token_factor() {
        let loads = loads(2);
        let start = Instant::now();
        // The profile says 16.5 ms fixed plus 0.0152 ms a token; the engines take 5.6 ms plus
        // 0.052 ms a token (a real vLLM on CPU): b / a = 10.1.
        let first_token = |instance, tokens: f64| {
            let token_ms = 0.0152 * tokens;
            let factor = loads.token_factor();
            let request = NewRequest {
                prompt: None,
                prefill_tokens: tokens as u64,
                profiled_ttft_ms: 16.5 + factor * token_ms,
                profiled_token_ms: token_ms,
                profiled_own_ms: 16.5 + factor * token_ms,
            };
            let id = loads.book(instance, request, start).unwrap();
            let took = Duration::from_secs_f64((5.6 + 0.052 * tokens) / 1000.0);
            loads.prefill_done(instance, id, start + took, true);
            loads.release(instance, id);
        };
        assert_eq!(loads.token_factor(), 1.0);
        for round in 0..100u32 {
            let tokens = 60.0 + 940.0 * f64::from((round * 37) % 100) / 100.0;
            first_token(u64::from(round % 2), tokens);
        }
        let learned = loads.token_factor();
        assert!(learned > 5.0 && learned < 12.0, "{learned}");
        // Shared with a replica that learned nothing itself, they score the same factor.
        let other = ActiveLoads::new();
        other.set_replicas_token_cost(loads.own().token_cost);
        assert!((other.token_factor() - learned).abs() < 1e-12);
        // Non-streamed first bytes teach nothing.
        let fresh = ActiveLoads::new();
        fresh.add(0);
        let request = NewRequest {
            prompt: None,
            prefill_tokens: 500,
            profiled_ttft_ms: 24.1,
            profiled_token_ms: 7.6,
            profiled_own_ms: 24.1,
        };
        let id = fresh.book(0, request.clone(), start).unwrap();
        fresh.prefill_done(0, id, start + Duration::from_millis(31), false);
        assert_eq!(fresh.own().token_cost, TokenCostSums::default());
        // Nor does a first token booked behind another request there; the first one does.
        let behind = fresh.book(0, request.clone(), start).unwrap();
        fresh.prefill_done(0, behind, start + Duration::from_millis(90), true);
        assert_eq!(fresh.own().token_cost, TokenCostSums::default());
        fresh.release(0, behind);
        fresh.release(0, id);
        let alone = fresh.book(0, request.clone(), start).unwrap();
        fresh.prefill_done(0, alone, start + Duration::from_millis(31), true);
        assert!((fresh.own().token_cost.weight - 1.0).abs() < 1e-12);
        fresh.release(0, alone);
        // Nor one booked alone that a later request joined before its first token (an
        // engine batches them: its time holds the other's work).
        let joined = fresh.book(0, request.clone(), start).unwrap();
        fresh.book(0, request, start).unwrap();
        let before = fresh.own().token_cost;
        fresh.prefill_done(0, joined, start + Duration::from_millis(60), true);
        assert_eq!(fresh.own().token_cost, before);
    }

    #[test]
    fn an_instance_no_replica_learned_is_scored_at_the_fleets_speed_as_the_replicas_share_it() {
        // This replica is new (no sample of its own); the others learned instance 0 at 4×
        // the profile from many samples and never saw instance 1.
        let loads = loads(2);
        let learned = SharedSpeed {
            ln_factor: 4f64.ln(),
            ln_variance: 0.01,
            samples: 400,
        };
        let fleet = learned;
        let speed = |instance, others| loads.snapshot_with(instance, &[], others, fleet).speed;
        // Both at the fleet's 4×: instance 0 because its samples agree with it, instance 1
        // because nothing sets it apart. (A profiled 1× for instance 1 would make it look
        // 4× faster than the one whose speed is known.)
        assert!(
            (speed(0, learned) - 4.0).abs() < 1e-9,
            "{}",
            speed(0, learned)
        );
        assert!((speed(1, SharedSpeed::default()) - 4.0).abs() < 1e-9);
        // Without the others' fleet, instance 1 falls back to this replica's (the profile).
        let alone = loads.snapshot_with(1, &[], SharedSpeed::default(), SharedSpeed::default());
        assert!((alone.speed - 1.0).abs() < 1e-9);
    }

    #[test]
    fn the_other_replicas_speed_samples_merge_with_this_ones() {
        let loads = loads(1);
        let start = Instant::now();
        let request = NewRequest {
            prompt: None,
            prefill_tokens: 8,
            profiled_ttft_ms: 40.0,
            profiled_token_ms: 0.0,
            profiled_own_ms: 40.0,
        };
        // This replica saw one first token at the profile's time: factor 1.
        let id = loads.book(0, request, start).unwrap();
        loads.prefill_done(0, id, start + Duration::from_millis(40), true);
        let own = loads.own().loads[&0].speed;
        assert_eq!((own.ln_factor, own.samples), (0.0, 1));
        // Another replica learned 4× slower from three: the merge weighs samples, 3 of 4.
        let others = SharedSpeed {
            ln_factor: 4f64.ln(),
            samples: 3,
            ..SharedSpeed::default()
        };
        let ln_merged = 0.75 * 4f64.ln();
        // Their pooled spread around it: 1 sample ln 4 × 0.75 away, 3 samples ln 4 × 0.25.
        let variance = 4f64.ln().powi(2) * (0.75f64.powi(2) + 3.0 * 0.25f64.powi(2)) / 4.0;
        // Assumed spread (0.25) as two more samples; two standard errors of 4 samples' mean.
        let margin = 2.0 * ((4.0 * variance + 2.0 * 0.25) / 6.0 / 4.0).sqrt();
        // With the prior (this replica's fleet factor, 1) as PRIOR_SAMPLES more samples.
        let proven = ln_merged - margin;
        let expected = (4.0 * proven / (4.0 + crate::kv::speed::PRIOR_SAMPLES)).exp();
        let speed = loads
            .snapshot_with(0, &[], others, SharedSpeed::default())
            .speed;
        assert!((speed - expected).abs() < 1e-9, "{speed} vs {expected}");
        assert!((loads.snapshot(0, &[]).speed - 1.0).abs() < 1e-9);
    }
}

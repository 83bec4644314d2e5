//! The scheduling logic, free of time and I/O: plan an iteration, then complete it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::sequence::Sequence;
use super::{Command, EventSender, SeqEvent, SeqOutcome};
use crate::config::{PreemptionMode, SimConfig};
use crate::hashing::BlockHasher;
use crate::kv_cache::{BlockId, KvCache};
use crate::kv_events::KvEventBatch;
use crate::metrics::{EngineMetrics, Finish};
use crate::output_text::Appended;

/// What one planned iteration does, for the timing model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StepPlan {
    /// New prompt (or recomputed) tokens in the batch.
    pub prefill_tokens: usize,
    /// Prompt tokens loaded from the host tier in the batch (not prefilled).
    pub loaded_tokens: usize,
    /// Sequences with work in the batch.
    pub batch: usize,
    /// KV usage after allocation.
    pub usage: f64,
}

/// A prefill leg's blocks, kept for a decode engine to read.
#[derive(Debug)]
struct Held {
    blocks: Vec<BlockId>,
    /// When they are freed if nobody read them.
    deadline: Instant,
}

/// Queues, KV cache and the per-iteration algorithm of vLLM's v1 scheduler (mocker flavour).
#[derive(Debug)]
pub(crate) struct SchedulerCore {
    block_size: usize,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    preemption: PreemptionMode,
    prefix_caching: bool,
    cache: KvCache,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    hasher: BlockHasher,
    metrics: Arc<EngineMetrics>,
    events: EventSender,
    /// Prefill legs' blocks by request id.
    held: HashMap<String, Held>,
    hold_timeout: Duration,
}

impl SchedulerCore {
    /// An idle scheduler with an empty cache.
    pub(crate) fn new(
        config: &SimConfig,
        metrics: Arc<EngineMetrics>,
        events: EventSender,
    ) -> Self {
        Self {
            block_size: config.block_size,
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            preemption: config.preemption_mode,
            prefix_caching: config.enable_prefix_caching,
            cache: KvCache::new(
                config.num_gpu_blocks,
                config.block_size,
                config.enable_prefix_caching,
            )
            .with_host_tier(config.offload.blocks, config.offload.events),
            waiting: VecDeque::new(),
            running: Vec::new(),
            hasher: BlockHasher::new(),
            metrics,
            events,
            held: HashMap::new(),
            hold_timeout: config.kv_transfer.hold_timeout,
        }
    }

    /// The metrics it writes.
    pub(crate) fn metrics(&self) -> Arc<EngineMetrics> {
        self.metrics.clone()
    }

    /// No sequence waiting or running.
    pub(crate) fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Applies one command from the inbox.
    pub(crate) fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(seqs) => self.waiting.extend(seqs.into_iter().map(Sequence::new)),
            Command::ReadHeld {
                request_id,
                block_ids,
                done,
            } => {
                let _ = done.send(self.read_held(request_id.as_deref(), &block_ids));
            }
            Command::CachedPrefix { hashes, done } => {
                let _ = done.send(self.cache.lookup(&hashes));
            }
            Command::ResetPrefixCache { restart, done } => {
                // Events recorded before the reset belong to the old event sequence.
                self.publish_events();
                self.cache.reset();
                self.publish(restart);
                let _ = done.send(());
            }
        }
    }

    /// Plans the next iteration: budget running sequences first (preempting when decode runs out
    /// of blocks), then admit waiting ones with chunked prefill.
    pub(crate) fn schedule(&mut self) -> StepPlan {
        self.drop_cancelled();
        let mut budget = self.max_num_batched_tokens;
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            let n = self.running[i].missing().min(budget);
            self.running[i].scheduled = 0;
            if n == 0 {
                i += 1;
                continue;
            }
            let need = self.blocks_needed(&self.running[i], n);
            let mut self_preempted = false;
            while need > self.cache.available() {
                let victim = match self.preemption {
                    PreemptionMode::Lifo => self.running.len() - 1,
                    PreemptionMode::Fifo => 0,
                };
                budget += self.preempt(victim);
                preempted = true;
                if victim == i {
                    self_preempted = true;
                    break;
                }
                if victim < i {
                    i -= 1;
                }
            }
            if self_preempted {
                continue;
            }
            self.allocate(i, need);
            self.running[i].scheduled = n;
            budget -= n;
            i += 1;
        }
        let loaded_tokens = if preempted {
            0
        } else {
            self.admit_waiting(&mut budget)
        };
        let mut plan = StepPlan {
            prefill_tokens: 0,
            loaded_tokens,
            batch: 0,
            usage: self.cache.usage(),
        };
        for seq in self.running.iter().filter(|s| s.scheduled > 0) {
            plan.batch += 1;
            if !seq.decoding {
                plan.prefill_tokens += seq.scheduled;
            }
        }
        if plan.batch == 0 && !preempted && self.running.is_empty() {
            self.fail_unschedulable();
        }
        self.metrics
            .set_load(self.running.len(), self.waiting.len(), plan.usage);
        plan
    }

    /// Ends the planned iteration at `now`: computed tokens advance, full blocks become cached
    /// (and are offloaded to the host tier), every sequence whose KV is complete samples one
    /// token.
    pub(crate) fn complete(&mut self, now: Instant) {
        for i in 0..self.running.len() {
            if self.running[i].scheduled == 0 {
                continue;
            }
            let seq = &mut self.running[i];
            seq.computed += seq.scheduled;
            seq.scheduled = 0;
            self.promote_full_blocks(i);
            let seq = &mut self.running[i];
            if seq.computed == seq.tokens.len() {
                Self::sample(seq, &self.metrics, now);
            }
        }
        self.cache.offload_stored();
        let mut held = false;
        let mut left = 0;
        for mut seq in self.running.extract_if(.., |s| s.done) {
            left += 1;
            match seq.hold.take() {
                Some(id) if !seq.cancelled() => {
                    let deadline = now + self.hold_timeout;
                    let blocks = std::mem::take(&mut seq.blocks);
                    if let Some(replaced) = self.held.insert(id, Held { blocks, deadline }) {
                        self.cache.release(&replaced.blocks);
                    }
                    held = true;
                }
                _ => self.cache.release(&seq.blocks),
            }
        }
        if held {
            self.count_held();
        }
        self.metrics.requests_left(left);
        self.metrics
            .set_load(self.running.len(), self.waiting.len(), self.cache.usage());
    }

    /// Frees the blocks held under `request_id` (or, without one, the hold of exactly
    /// `block_ids`); how many there were.
    fn read_held(&mut self, request_id: Option<&str>, block_ids: &[u64]) -> Option<usize> {
        let key = match request_id {
            Some(id) => id.to_owned(),
            None => self
                .held
                .iter()
                .find(|(_, held)| {
                    held.blocks
                        .iter()
                        .map(|&b| u64::from(b))
                        .eq(block_ids.iter().copied())
                })
                .map(|(id, _)| id.clone())?,
        };
        let held = self.held.remove(&key)?;
        self.cache.release(&held.blocks);
        self.count_held();
        Some(held.blocks.len())
    }

    /// Frees the holds whose time ran out by `now`.
    pub(crate) fn expire_held(&mut self, now: Instant) {
        let before = self.held.len();
        let cache = &mut self.cache;
        self.held.retain(|_, held| {
            let keep = held.deadline > now;
            if !keep {
                cache.release(&held.blocks);
            }
            keep
        });
        let expired = before - self.held.len();
        if expired > 0 {
            self.metrics.holds_expired(expired);
            self.count_held();
        }
    }

    /// When the next hold runs out, if any is held.
    pub(crate) fn next_hold_deadline(&self) -> Option<Instant> {
        self.held.values().map(|held| held.deadline).min()
    }

    fn count_held(&self) {
        let blocks = self.held.values().map(|held| held.blocks.len()).sum();
        self.metrics.set_held_blocks(blocks);
    }

    /// Hands the events recorded since the last call to the subscribers.
    pub(crate) fn publish_events(&mut self) {
        self.publish(false);
    }

    fn publish(&mut self, engine_restarted: bool) {
        let events = self.cache.take_events();
        if events.is_empty() || self.events.receiver_count() == 0 {
            return;
        }
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let _ = self.events.send(Arc::new(KvEventBatch {
            timestamp,
            events,
            engine_restarted,
        }));
    }

    fn blocks_needed(&self, seq: &Sequence, n: usize) -> usize {
        (seq.computed + n)
            .div_ceil(self.block_size)
            .saturating_sub(seq.blocks.len())
    }

    fn allocate(&mut self, i: usize, need: usize) {
        for _ in 0..need {
            // The caller checked `available()`, so allocation cannot fail here.
            if let Some(id) = self.cache.allocate() {
                self.running[i].blocks.push(id);
            }
        }
    }

    /// Moves running sequence `i` back to the front of the waiting queue, freeing its blocks.
    /// Returns the tokens it had been given this iteration.
    fn preempt(&mut self, i: usize) -> usize {
        let mut seq = self.running.remove(i);
        self.cache.release(&seq.blocks);
        seq.blocks.clear();
        seq.engine_hashes.clear();
        seq.computed = 0;
        seq.decoding = false;
        let refund = std::mem::take(&mut seq.scheduled);
        self.metrics.preempted();
        self.waiting.push_front(seq);
        refund
    }

    /// Admits waiting sequences while the budget, the sequence limit and the free blocks
    /// allow; returns the prompt tokens they load from the host tier.
    fn admit_waiting(&mut self, budget: &mut usize) -> usize {
        let mut loaded_tokens = 0;
        while *budget > 0 && self.running.len() < self.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else {
                break;
            };
            if self.prefix_caching {
                self.hasher.extend_salted_sequence_hashes(
                    &seq.tokens,
                    self.block_size,
                    seq.hash_seed,
                    seq.cache_salt.as_deref(),
                    &mut seq.hashes,
                );
            }
            // vLLM always computes at least the last prompt token.
            let max_hit =
                (seq.tokens.len().saturating_sub(1) / self.block_size).min(seq.hashes.len());
            let hit = self.cache.lookup(&seq.hashes[..max_hit]);
            // A decode leg's pulled blocks count as computed, as the cached ones do.
            let pulled = (seq.pulled_tokens / self.block_size)
                .min(seq.tokens.len().saturating_sub(1) / self.block_size);
            let local = hit.max(pulled);
            // Of the blocks after those, the leading ones the host tier holds are loaded:
            // computed too, within the same cap.
            let loaded = if local < max_hit {
                self.cache.host_lookup(&seq.hashes[local..max_hit])
            } else {
                0
            };
            let start = (local + loaded) * self.block_size;
            let n = (seq.tokens.len() - start).min(*budget);
            let need = (start + n).div_ceil(self.block_size) - hit;
            let available = self.cache.available() - self.cache.inactive_among(&seq.hashes[..hit]);
            if need > available {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            for (id, engine_hash) in self.cache.acquire(&seq.hashes[..hit]) {
                seq.blocks.push(id);
                seq.engine_hashes.push(engine_hash);
            }
            seq.computed = start;
            seq.pulled_tokens = 0;
            seq.epoch = self.cache.epoch();
            // vLLM's cached_tokens counts the device hit and the connector's load together.
            seq.cached_tokens
                .get_or_insert((hit + loaded) * self.block_size);
            self.metrics
                .prefix_lookup(seq.tokens.len(), hit * self.block_size);
            if self.cache.has_host_tier() {
                self.metrics.external_prefix_lookup(
                    seq.tokens.len() - hit * self.block_size,
                    loaded * self.block_size,
                );
            }
            self.cache.host_touch(&seq.hashes[local..local + loaded]);
            loaded_tokens += loaded * self.block_size;
            seq.scheduled = n;
            *budget -= n;
            self.running.push(seq);
            let last = self.running.len() - 1;
            self.allocate(last, need);
        }
        loaded_tokens
    }

    /// Makes every newly filled block of running sequence `i` a cached block.
    fn promote_full_blocks(&mut self, i: usize) {
        if !self.prefix_caching {
            return;
        }
        let seq = &mut self.running[i];
        let full = seq.computed / self.block_size;
        if seq.engine_hashes.len() >= full {
            return;
        }
        self.hasher.extend_salted_sequence_hashes(
            &seq.tokens[..full * self.block_size],
            self.block_size,
            seq.hash_seed,
            seq.cache_salt.as_deref(),
            &mut seq.hashes,
        );
        let current = seq.epoch == self.cache.epoch();
        for b in seq.engine_hashes.len()..full {
            let tokens = &seq.tokens[b * self.block_size..(b + 1) * self.block_size];
            let parent = seq.engine_hashes.last().copied();
            let engine_hash = self.hasher.salted_engine_hash(
                parent.map(|p| p.id()),
                tokens,
                seq.lora_name(),
                seq.cache_salt.as_deref(),
            );
            if current {
                self.cache.promote(
                    seq.blocks[b],
                    seq.hashes[b],
                    engine_hash,
                    parent,
                    tokens,
                    seq.lora.as_ref(),
                    seq.cache_salt.as_ref(),
                );
            }
            seq.engine_hashes.push(engine_hash);
        }
    }

    fn sample(seq: &mut Sequence, metrics: &EngineMetrics, now: Instant) {
        let (word, id) = seq.words.next_word();
        seq.tokens.push(id);
        seq.generated += 1;
        seq.decoding = true;
        match seq.last_token {
            None => metrics.first_token(
                seq.prompt_len,
                now.duration_since(seq.arrival).as_secs_f64(),
            ),
            Some(prev) => metrics.next_token(now.duration_since(prev).as_secs_f64()),
        }
        let first = seq.last_token.is_none();
        seq.last_token = Some(now);
        let finish = match seq.text.push_word(word) {
            Appended::Stopped(i) => Some((Finish::Stop, seq.text.stops().get(i).cloned())),
            Appended::Continue if seq.generated >= seq.max_tokens => Some((Finish::Length, None)),
            Appended::Continue => None,
        };
        let sent = match finish {
            Some((finish, stop)) => {
                seq.done = true;
                metrics.finished(finish, now.duration_since(seq.arrival).as_secs_f64());
                let text = if seq.stream {
                    seq.text.take_delta(true)
                } else {
                    seq.text.take_text()
                };
                seq.tx.send(SeqEvent::Finished(SeqOutcome {
                    index: seq.index,
                    text,
                    finish,
                    stop,
                    prompt_tokens: seq.prompt_len,
                    completion_tokens: seq.generated,
                    cached_tokens: seq.cached_tokens.unwrap_or(0),
                    held_blocks: if seq.hold.is_some() {
                        seq.blocks.iter().map(|&b| u64::from(b)).collect()
                    } else {
                        Vec::new()
                    },
                }))
            }
            None if seq.stream => {
                let text = seq.text.take_delta(false);
                if text.is_empty() && !first {
                    Ok(())
                } else {
                    seq.tx.send(SeqEvent::Delta {
                        index: seq.index,
                        text,
                    })
                }
            }
            None => Ok(()),
        };
        if sent.is_err() {
            seq.done = true;
        }
    }

    fn drop_cancelled(&mut self) {
        let before = self.running.len() + self.waiting.len();
        for seq in self.running.extract_if(.., |s| s.cancelled()) {
            self.cache.release(&seq.blocks);
        }
        self.waiting.retain(|s| !s.cancelled());
        self.metrics
            .requests_left(before - self.running.len() - self.waiting.len());
    }

    /// Nothing runs and the head of the queue still cannot start: it never will, so fail it
    /// rather than stall the queue (requests are size-checked on arrival, so this is a safeguard).
    fn fail_unschedulable(&mut self) {
        if let Some(seq) = self.waiting.pop_front() {
            self.metrics.requests_left(1);
            let _ = seq.tx.send(SeqEvent::Failed {
                index: seq.index,
                message: format!(
                    "the sequence needs more KV blocks than the engine has ({} blocks of {} tokens)",
                    self.cache.num_blocks(),
                    self.block_size
                ),
            });
        }
    }

    #[cfg(test)]
    fn cache(&self) -> &KvCache {
        &self.cache
    }

    #[cfg(test)]
    fn queue_lengths(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    #[cfg(test)]
    fn enqueue(&mut self, req: super::SeqRequest) {
        self.handle(Command::Submit(vec![req]));
    }
}

#[cfg(test)]
mod tests;

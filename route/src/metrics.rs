//! The metric families of `policy: kv` (prefix `kvmesh_`), registered into the caller's
//! registry; each model resolves its label children once ([`KvFamilies::model`]) so routing
//! touches only atomics.

use std::time::Duration;

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

use crate::kv::TokenizerOutcome;
use crate::kv::cache_check::Verdict;
use crate::prepare::{FALLBACK_REASONS, FallbackReason};

/// Routing-decision stage buckets (seconds): from a hash lookup to a long tokenization.
const STAGE_BUCKETS: &[f64] = &[
    0.000_001, 0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001,
    0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];
/// Overlap buckets (blocks).
const OVERLAP_BUCKETS: &[f64] = &[
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
];

/// Buckets of an index's expected minus an engine's actual cached blocks.
const CHECK_BUCKETS: &[f64] = &[
    -64.0, -16.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 16.0, 64.0,
];

/// The families of `policy: kv`.
#[derive(Debug, Clone)]
pub struct KvFamilies {
    overlap_blocks: HistogramVec,
    decision_seconds: HistogramVec,
    index_blocks: IntGaugeVec,
    index_evicted_blocks: IntGaugeVec,
    index_bytes: IntGaugeVec,
    token_factor: GaugeVec,
    instance_speed: GaugeVec,
    index_prunes: IntCounterVec,
    busy_rejections: IntCounterVec,
    queue_depth: IntGaugeVec,
    fallbacks: IntCounterVec,
    block_size_mismatch: IntGaugeVec,
    cache_check_blocks: HistogramVec,
    cache_check_answers: IntCounterVec,
    cache_check_mismatches: IntCounterVec,
    cache_check_untrusted: IntGaugeVec,
    events_incomplete: IntGaugeVec,
    tokenizer_mismatch: IntGaugeVec,
    tokenizer_checks: IntCounterVec,
    decider_asks: IntCounterVec,
    decided_for_replicas: IntCounterVec,
    decider_share_waits: IntCounterVec,
}

impl KvFamilies {
    /// Creates the families and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let overlap_blocks = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_route_overlap_blocks",
                "policy kv: cached prefix blocks of the chosen instance, per routing decision.",
            )
            .buckets(OVERLAP_BUCKETS.to_vec()),
            &["model"],
        )?;
        let decision_seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_route_decision_seconds",
                "policy kv: time per routing stage (template: body parsing and chat template, tokenize, hash, lookup, score; ask: a replica's wait for its model's decider to answer).",
            )
            .buckets(STAGE_BUCKETS.to_vec()),
            &["model", "stage"],
        )?;
        let index_blocks = IntGaugeVec::new(
            Opts::new(
                "kvmesh_index_blocks",
                "policy kv: blocks the KV index holds per instance.",
            ),
            &["model", "instance"],
        )?;
        let index_evicted_blocks = IntGaugeVec::new(
            Opts::new(
                "kvmesh_index_evicted_blocks",
                "policy kv: (instance, block) pairs the KV index evicted past kv.index_max_blocks since the proxy started.",
            ),
            &["model"],
        )?;
        let index_bytes = IntGaugeVec::new(
            Opts::new(
                "kvmesh_index_bytes",
                "policy kv: heap bytes the event-fed KV index holds (its tables' capacity), for sizing kv.index_max_blocks.",
            ),
            &["model"],
        )?;
        let token_factor = GaugeVec::new(
            Opts::new(
                "kvmesh_route_token_factor",
                "policy kv: how much more (above 1) or less the model's engines spend per prefilled token, against an iteration's fixed part, than the cost model's engine profile says, learned from first-token times.",
            ),
            &["model"],
        )?;
        let instance_speed = GaugeVec::new(
            Opts::new(
                "kvmesh_route_instance_speed",
                "policy kv: how much slower (above 1) or faster than the cost model's engine profile an instance proved to be, learned from its first-token times.",
            ),
            &["model", "instance"],
        )?;
        let index_prunes = IntCounterVec::new(
            Opts::new(
                "kvmesh_index_prunes_total",
                "policy kv: predicted blocks pruned to stay under kv.approx_max_blocks.",
            ),
            &["model"],
        )?;
        let busy_rejections = IntCounterVec::new(
            Opts::new(
                "kvmesh_route_busy_rejections_total",
                "policy kv: requests answered 503 because every instance was busy.",
            ),
            &["model"],
        )?;
        let queue_depth = IntGaugeVec::new(
            Opts::new(
                "kvmesh_route_queue_depth",
                "policy kv: requests waiting for a non-busy instance.",
            ),
            &["model"],
        )?;
        let fallbacks = IntCounterVec::new(
            Opts::new(
                "kvmesh_route_fallbacks_total",
                "policy kv: requests routed by load alone, without tokens, by reason.",
            ),
            &["model", "reason"],
        )?;
        let block_size_mismatch = IntGaugeVec::new(
            Opts::new(
                "kvmesh_route_block_size_mismatch",
                "policy kv: 1 while an instance's engine runs another KV block size (from its instance record) than its model's kv.block_size; it is then scored by predictions alone, not by its KV events.",
            ),
            &["model", "instance"],
        )?;
        let cache_check_blocks = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_route_cache_check_blocks",
                "policy kv: per judged answer, the prompt blocks the KV index expected the engine to have cached minus those its cached_tokens reported (both capped as vLLM caps a full hit).",
            )
            .buckets(CHECK_BUCKETS.to_vec()),
            &["model"],
        )?;
        let cache_check_answers = IntCounterVec::new(
            Opts::new(
                "kvmesh_route_cache_check_answers_total",
                "policy kv: answers checked against the KV index by their cached_tokens, by result (agreed, disagreed, without_cached_tokens: usage without prompt_tokens_details, not judged).",
            ),
            &["model", "result"],
        )?;
        let cache_check_mismatches = IntCounterVec::new(
            Opts::new(
                "kvmesh_route_cache_check_mismatches_total",
                "policy kv: answers whose cached_tokens disagreed with the KV index, per instance.",
            ),
            &["model", "instance"],
        )?;
        let cache_check_untrusted = IntGaugeVec::new(
            Opts::new(
                "kvmesh_route_cache_check_untrusted",
                "policy kv: 1 while an instance is scored by predictions alone because its answers' cached_tokens disagreed with the KV index (kv.cache_check), until its resync answers.",
            ),
            &["model", "instance"],
        )?;
        let events_incomplete = IntGaugeVec::new(
            Opts::new(
                "kvmesh_route_kv_events_incomplete",
                "policy kv: 1 while an instance's agent has lost KV events its engine could not replay (its load reports say so); the instance is scored by predictions alone until its engine clears its cache or restarts.",
            ),
            &["model", "instance"],
        )?;
        let tokenizer_mismatch = IntGaugeVec::new(
            Opts::new(
                "kvmesh_route_tokenizer_mismatch",
                "policy kv: 1 while an instance's engine tokenized a probe prompt (its /tokenize, asked when it registered) otherwise than the proxy's tokenizer and chat template; it is then scored by predictions alone, not by its KV events.",
            ),
            &["model", "instance"],
        )?;
        let tokenizer_checks = IntCounterVec::new(
            Opts::new(
                "kvmesh_route_tokenizer_checks_total",
                "policy kv: instances whose engine's /tokenize was compared with the proxy's tokenizer, by outcome (agreed, mismatched, unchecked: no /tokenize, refused, or no answer before kv.tokenizer_check.deadline).",
            ),
            &["model", "outcome"],
        )?;
        let decider_asks = IntCounterVec::new(
            Opts::new(
                "kvmesh_route_decider_asks_total",
                "policy kv: requests this replica asked its model's decider (another replica) to route, by outcome (chosen: routed as it answered; declined: it did not choose; timeout: no answer within kv.decider_timeout; unavailable: the ask could not be sent; skipped: not asked, within 250 ms of a timeout; decisive: not asked, its own choice stood even against an unseen request like it from every other replica). All but chosen were routed by this replica alone.",
            ),
            &["model", "outcome"],
        )?;
        let decided_for_replicas = IntCounterVec::new(
            Opts::new(
                "kvmesh_route_decided_for_replicas_total",
                "policy kv: requests of other replicas this replica routed as its model's decider.",
            ),
            &["model"],
        )?;
        let decider_share_waits = IntCounterVec::new(
            Opts::new(
                "kvmesh_route_decider_share_waits_total",
                "policy kv: asks this replica, as its model's decider, held until the asker's load share showed the load it had shed before asking (a first token, a request's end), by outcome (shown: it arrived within the wait, at most 5 ms; late: decided without it).",
            ),
            &["model", "outcome"],
        )?;
        registry.register(Box::new(decider_asks.clone()))?;
        registry.register(Box::new(decided_for_replicas.clone()))?;
        registry.register(Box::new(decider_share_waits.clone()))?;
        registry.register(Box::new(overlap_blocks.clone()))?;
        registry.register(Box::new(decision_seconds.clone()))?;
        registry.register(Box::new(index_blocks.clone()))?;
        registry.register(Box::new(index_evicted_blocks.clone()))?;
        registry.register(Box::new(index_bytes.clone()))?;
        registry.register(Box::new(token_factor.clone()))?;
        registry.register(Box::new(instance_speed.clone()))?;
        registry.register(Box::new(index_prunes.clone()))?;
        registry.register(Box::new(busy_rejections.clone()))?;
        registry.register(Box::new(queue_depth.clone()))?;
        registry.register(Box::new(fallbacks.clone()))?;
        registry.register(Box::new(block_size_mismatch.clone()))?;
        registry.register(Box::new(cache_check_blocks.clone()))?;
        registry.register(Box::new(cache_check_answers.clone()))?;
        registry.register(Box::new(cache_check_mismatches.clone()))?;
        registry.register(Box::new(cache_check_untrusted.clone()))?;
        registry.register(Box::new(events_incomplete.clone()))?;
        registry.register(Box::new(tokenizer_mismatch.clone()))?;
        registry.register(Box::new(tokenizer_checks.clone()))?;
        Ok(Self {
            overlap_blocks,
            decision_seconds,
            index_blocks,
            index_evicted_blocks,
            index_bytes,
            token_factor,
            instance_speed,
            index_prunes,
            busy_rejections,
            queue_depth,
            fallbacks,
            block_size_mismatch,
            cache_check_blocks,
            cache_check_answers,
            cache_check_mismatches,
            cache_check_untrusted,
            events_incomplete,
            tokenizer_mismatch,
            tokenizer_checks,
            decider_asks,
            decided_for_replicas,
            decider_share_waits,
        })
    }

    /// Handles of `model`.
    pub fn model(&self, model: &str) -> KvMetrics {
        KvMetrics {
            model: model.to_string(),
            overlap_blocks: self.overlap_blocks.with_label_values(&[model]),
            stages: RouteStage::ALL.map(|stage| {
                self.decision_seconds
                    .with_label_values(&[model, stage.label()])
            }),
            index_blocks: self.index_blocks.clone(),
            instance_speed: self.instance_speed.clone(),
            index_prunes: self.index_prunes.with_label_values(&[model]),
            index_evicted_blocks: self.index_evicted_blocks.with_label_values(&[model]),
            index_bytes: self.index_bytes.with_label_values(&[model]),
            token_factor: self.token_factor.with_label_values(&[model]),
            busy_rejections: self.busy_rejections.with_label_values(&[model]),
            queue_depth: self.queue_depth.with_label_values(&[model]),
            fallbacks: FallbackReason::ALL
                .map(|reason| self.fallbacks.with_label_values(&[model, reason.label()])),
            block_size_mismatch: self.block_size_mismatch.clone(),
            cache_check_blocks: self.cache_check_blocks.with_label_values(&[model]),
            cache_check_answers: CHECK_RESULTS
                .map(|result| self.cache_check_answers.with_label_values(&[model, result])),
            cache_check_mismatches: self.cache_check_mismatches.clone(),
            cache_check_untrusted: self.cache_check_untrusted.clone(),
            events_incomplete: self.events_incomplete.clone(),
            tokenizer_mismatch: self.tokenizer_mismatch.clone(),
            tokenizer_checks: TokenizerOutcome::LABELS
                .map(|outcome| self.tokenizer_checks.with_label_values(&[model, outcome])),
            decider_asks: AskOutcome::ALL.map(|outcome| {
                self.decider_asks
                    .with_label_values(&[model, outcome.label()])
            }),
            decided_for_replicas: self.decided_for_replicas.with_label_values(&[model]),
            decider_share_waits: ["shown", "late"].map(|outcome| {
                self.decider_share_waits
                    .with_label_values(&[model, outcome])
            }),
        }
    }

    /// Drops the series of instance `instance` (its URL) of `model`: it left the pool.
    pub fn forget_instance(&self, model: &str, instance: &str) {
        let _ = self.index_blocks.remove_label_values(&[model, instance]);
        let _ = self.instance_speed.remove_label_values(&[model, instance]);
        let _ = self
            .block_size_mismatch
            .remove_label_values(&[model, instance]);
        let _ = self
            .cache_check_mismatches
            .remove_label_values(&[model, instance]);
        let _ = self
            .cache_check_untrusted
            .remove_label_values(&[model, instance]);
        let _ = self
            .events_incomplete
            .remove_label_values(&[model, instance]);
        let _ = self
            .tokenizer_mismatch
            .remove_label_values(&[model, instance]);
    }
}

/// A stage of a `policy: kv` routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteStage {
    /// Parsing the body (chat: and rendering its template; completions: reading the prompt).
    Template,
    /// Tokenizing the prompt.
    Tokenize,
    /// Hashing its blocks.
    Hash,
    /// Looking the blocks up in the KV index.
    Lookup,
    /// Reading loads, costing and selecting.
    Score,
    /// Waiting for the model's decider (another replica) to answer an ask: sent to answered
    /// or timed out.
    Ask,
}

/// Number of [`RouteStage`]s.
const ROUTE_STAGES: usize = 6;

impl RouteStage {
    /// Every stage, in declaration order.
    pub const ALL: [RouteStage; ROUTE_STAGES] = [
        Self::Template,
        Self::Tokenize,
        Self::Hash,
        Self::Lookup,
        Self::Score,
        Self::Ask,
    ];

    /// The `stage` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Template => "template",
            Self::Tokenize => "tokenize",
            Self::Hash => "hash",
            Self::Lookup => "lookup",
            Self::Score => "score",
            Self::Ask => "ask",
        }
    }
}

/// Handles of one `policy: kv` model.
#[derive(Debug)]
pub struct KvMetrics {
    model: String,
    /// `kvmesh_route_overlap_blocks{model}`.
    pub(crate) overlap_blocks: Histogram,
    stages: [Histogram; ROUTE_STAGES],
    /// `kvmesh_index_blocks{model,instance}` (instances come and go: resolved per scrape).
    index_blocks: IntGaugeVec,
    /// `kvmesh_route_instance_speed{model,instance}`, resolved per scrape too.
    instance_speed: GaugeVec,
    /// `kvmesh_index_prunes_total{model}`.
    pub(crate) index_prunes: IntCounter,
    /// `kvmesh_index_evicted_blocks{model}`.
    index_evicted_blocks: IntGauge,
    /// `kvmesh_index_bytes{model}`.
    index_bytes: IntGauge,
    /// `kvmesh_route_token_factor{model}`.
    token_factor: Gauge,
    /// `kvmesh_route_busy_rejections_total{model}`.
    pub(crate) busy_rejections: IntCounter,
    /// `kvmesh_route_queue_depth{model}`.
    pub(crate) queue_depth: IntGauge,
    fallbacks: [IntCounter; FALLBACK_REASONS],
    /// `kvmesh_route_block_size_mismatch{model,instance}`, resolved per scrape.
    block_size_mismatch: IntGaugeVec,
    /// `kvmesh_route_cache_check_blocks{model}`.
    cache_check_blocks: Histogram,
    /// `kvmesh_route_cache_check_answers_total{model,result}`, in [`CHECK_RESULTS`] order.
    cache_check_answers: [IntCounter; 3],
    /// `kvmesh_route_cache_check_mismatches_total{model,instance}`, resolved per mismatch.
    cache_check_mismatches: IntCounterVec,
    /// `kvmesh_route_cache_check_untrusted{model,instance}`, resolved per scrape.
    cache_check_untrusted: IntGaugeVec,
    /// `kvmesh_route_kv_events_incomplete{model,instance}`, resolved per scrape.
    events_incomplete: IntGaugeVec,
    /// `kvmesh_route_tokenizer_mismatch{model,instance}`, resolved per scrape.
    tokenizer_mismatch: IntGaugeVec,
    /// `kvmesh_route_tokenizer_checks_total{model,outcome}`, in [`TokenizerOutcome::LABELS`]
    /// order.
    tokenizer_checks: [IntCounter; 3],
    /// `kvmesh_route_decider_asks_total{model,outcome}`, in [`AskOutcome::ALL`] order.
    decider_asks: [IntCounter; 6],
    /// `kvmesh_route_decided_for_replicas_total{model}`.
    pub(crate) decided_for_replicas: IntCounter,
    /// `kvmesh_route_decider_share_waits_total{model,outcome}`: shown, late.
    decider_share_waits: [IntCounter; 2],
}

/// How asking the model's decider ended (`kvmesh_route_decider_asks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AskOutcome {
    /// It chose; the request goes there.
    Chosen,
    /// It answered without choosing.
    Declined,
    /// No answer within `kv.decider_timeout`.
    Timeout,
    /// The ask could not be sent (no connection, nobody serving the decider's subject).
    Unavailable,
    /// Not asked: an ask timed out less than [`crate::kv::QUIET_AFTER_TIMEOUT`] ago.
    Skipped,
    /// Not asked: this replica's own choice stood even against a request like it from
    /// every other replica, unseen (the decider would choose the same).
    Decisive,
}

impl AskOutcome {
    const ALL: [AskOutcome; 6] = [
        Self::Chosen,
        Self::Declined,
        Self::Timeout,
        Self::Unavailable,
        Self::Skipped,
        Self::Decisive,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Chosen => "chosen",
            Self::Declined => "declined",
            Self::Timeout => "timeout",
            Self::Unavailable => "unavailable",
            Self::Skipped => "skipped",
            Self::Decisive => "decisive",
        }
    }
}

/// The `result` labels of `kvmesh_route_cache_check_answers_total`.
const CHECK_RESULTS: [&str; 3] = ["agreed", "disagreed", "without_cached_tokens"];

impl KvMetrics {
    /// Counts one ask of the model's decider that ended as `outcome`.
    pub(crate) fn count_ask(&self, outcome: AskOutcome) {
        self.decider_asks[outcome as usize].inc();
    }

    /// Counts one ask the decider held for the asker's load share: `shown` when the share
    /// arrived in time.
    pub(crate) fn count_share_wait(&self, shown: bool) {
        self.decider_share_waits[usize::from(!shown)].inc();
    }

    /// Records the time one stage took.
    pub fn observe_stage(&self, stage: RouteStage, elapsed: Duration) {
        if let Some(histogram) = self.stages.get(stage as usize) {
            histogram.observe(elapsed.as_secs_f64());
        }
    }

    /// Sets `kvmesh_index_blocks` of `instance` (its URL).
    pub fn set_index_blocks(&self, instance: &str, blocks: u64) {
        self.index_blocks
            .with_label_values(&[self.model.as_str(), instance])
            .set(i64::try_from(blocks).unwrap_or(i64::MAX));
    }

    /// Sets `kvmesh_route_token_factor`.
    pub fn set_token_factor(&self, factor: f64) {
        self.token_factor.set(factor);
    }

    /// Sets `kvmesh_index_bytes`.
    pub fn set_index_bytes(&self, bytes: usize) {
        self.index_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Sets `kvmesh_index_evicted_blocks`.
    pub fn set_index_evicted_blocks(&self, evicted: u64) {
        self.index_evicted_blocks
            .set(i64::try_from(evicted).unwrap_or(i64::MAX));
    }

    /// Sets `kvmesh_route_instance_speed` of `instance` (its URL).
    pub fn set_instance_speed(&self, instance: &str, speed: f64) {
        self.instance_speed
            .with_label_values(&[self.model.as_str(), instance])
            .set(speed);
    }

    /// Sets `kvmesh_route_block_size_mismatch` of `instance` (its URL): 1 while its engine
    /// runs another block size than the model.
    pub fn set_block_size_mismatch(&self, instance: &str, mismatch: bool) {
        self.block_size_mismatch
            .with_label_values(&[self.model.as_str(), instance])
            .set(i64::from(mismatch));
    }

    /// Sets `kvmesh_route_cache_check_untrusted` of `instance` (its URL).
    pub fn set_cache_check_untrusted(&self, instance: &str, untrusted: bool) {
        self.cache_check_untrusted
            .with_label_values(&[self.model.as_str(), instance])
            .set(i64::from(untrusted));
    }

    /// Sets `kvmesh_route_kv_events_incomplete` of `instance` (its URL).
    pub fn set_events_incomplete(&self, instance: &str, incomplete: bool) {
        self.events_incomplete
            .with_label_values(&[self.model.as_str(), instance])
            .set(i64::from(incomplete));
    }

    /// Sets `kvmesh_route_tokenizer_mismatch` of `instance` (its URL): 1 while its engine
    /// tokenizes otherwise than the proxy.
    pub fn set_tokenizer_mismatch(&self, instance: &str, mismatch: bool) {
        self.tokenizer_mismatch
            .with_label_values(&[self.model.as_str(), instance])
            .set(i64::from(mismatch));
    }

    /// Counts an instance's tokenizer check by its outcome.
    pub(crate) fn count_tokenizer_check(&self, outcome: &TokenizerOutcome) {
        if let Some(counter) = self.tokenizer_checks.get(outcome.index()) {
            counter.inc();
        }
    }

    /// Counts an answer of `instance` (its URL) judged against the index: `verdict`, and the
    /// expected minus the actual cached blocks.
    pub(crate) fn count_cache_check(&self, instance: &str, verdict: Verdict, difference: i64) {
        self.cache_check_blocks.observe(difference as f64);
        let agreed = verdict == Verdict::Agreed;
        self.cache_check_answers[usize::from(!agreed)].inc();
        if !agreed {
            self.cache_check_mismatches
                .with_label_values(&[self.model.as_str(), instance])
                .inc();
        }
    }

    /// Counts an answer with usage but without `cached_tokens` (not judged).
    pub(crate) fn count_without_cached_tokens(&self) {
        self.cache_check_answers[2].inc();
    }

    /// Counts a request routed without tokens.
    pub fn count_fallback(&self, reason: FallbackReason) {
        if let Some(counter) = self.fallbacks.get(reason.index()) {
            counter.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::{Encoder, TextEncoder};

    use super::*;

    fn text(registry: &Registry) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&registry.gather(), &mut out)
            .unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn renders_the_kv_families() {
        let registry = Registry::new();
        let families = KvFamilies::register(&registry).unwrap();
        let kv = families.model("qwen3");
        kv.overlap_blocks.observe(12.0);
        kv.observe_stage(RouteStage::Tokenize, Duration::from_micros(900));
        kv.set_index_blocks("http://b:2", 40);
        kv.set_index_blocks("http://a:1", 0);
        kv.index_prunes.inc_by(3);
        kv.set_index_evicted_blocks(7);
        kv.set_index_bytes(4096);
        kv.set_token_factor(2.5);
        kv.busy_rejections.inc();
        kv.queue_depth.set(2);
        kv.count_fallback(FallbackReason::NoTokenizer);
        kv.set_block_size_mismatch("http://b:2", true);
        kv.set_block_size_mismatch("http://a:1", false);
        kv.set_tokenizer_mismatch("http://b:2", true);
        kv.count_tokenizer_check(&TokenizerOutcome::Agreed);
        let out = text(&registry);
        families.forget_instance("qwen3", "http://b:2");
        assert!(!text(&registry).contains("http://b:2"));
        for line in [
            "kvmesh_route_overlap_blocks_count{model=\"qwen3\"} 1",
            "kvmesh_route_decision_seconds_count{model=\"qwen3\",stage=\"tokenize\"} 1",
            "kvmesh_route_decision_seconds_count{model=\"qwen3\",stage=\"score\"} 0",
            "kvmesh_index_blocks{instance=\"http://b:2\",model=\"qwen3\"} 40",
            "kvmesh_route_token_factor{model=\"qwen3\"} 2.5",
            "kvmesh_index_blocks{instance=\"http://a:1\",model=\"qwen3\"} 0",
            "kvmesh_index_prunes_total{model=\"qwen3\"} 3",
            "kvmesh_index_evicted_blocks{model=\"qwen3\"} 7",
            "kvmesh_index_bytes{model=\"qwen3\"} 4096",
            "kvmesh_route_busy_rejections_total{model=\"qwen3\"} 1",
            "kvmesh_route_queue_depth{model=\"qwen3\"} 2",
            "kvmesh_route_fallbacks_total{model=\"qwen3\",reason=\"no_tokenizer\"} 1",
            "kvmesh_route_block_size_mismatch{instance=\"http://b:2\",model=\"qwen3\"} 1",
            "kvmesh_route_block_size_mismatch{instance=\"http://a:1\",model=\"qwen3\"} 0",
            "kvmesh_route_tokenizer_mismatch{instance=\"http://b:2\",model=\"qwen3\"} 1",
            "kvmesh_route_tokenizer_checks_total{model=\"qwen3\",outcome=\"agreed\"} 1",
            "kvmesh_route_tokenizer_checks_total{model=\"qwen3\",outcome=\"unchecked\"} 0",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
        let mut labels: Vec<_> = RouteStage::ALL.iter().map(|s| s.label()).collect();
        labels.dedup();
        assert_eq!(labels.len(), ROUTE_STAGES);
    }
}

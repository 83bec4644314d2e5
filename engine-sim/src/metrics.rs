//! The engine's Prometheus metrics under vLLM's names (`vllm:*`).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::SimConfig;
use crate::histogram::{E2E_BUCKETS, FINE_ITL_BUCKETS, Histogram, ITL_BUCKETS, TTFT_BUCKETS};

/// Counters, gauges and histograms of one engine. Written by the scheduler, read by `/metrics`.
#[derive(Debug)]
pub(crate) struct EngineMetrics {
    labels: String,
    cache_config_labels: String,
    running: AtomicU64,
    waiting: AtomicU64,
    kv_usage_bits: AtomicU64,
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    preemptions: AtomicU64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    success_stop: AtomicU64,
    success_length: AtomicU64,
    kv_events_published: bool,
    kv_batches_sent: AtomicU64,
    kv_batches_lagged: AtomicU64,
    kv_batches_fault_dropped: AtomicU64,
    held_blocks: AtomicU64,
    holds_expired: AtomicU64,
    transfers_ok: AtomicU64,
    transfers_failed: AtomicU64,
    transfer_bytes: AtomicU64,
    transfer_micros: AtomicU64,
    transfers_in_flight: AtomicU64,
    ttft: Histogram,
    itl: Histogram,
    fine_itl: Histogram,
    e2e: Histogram,
}

/// A snapshot of the main counters, for tests.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CounterSnapshot {
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits: u64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Finished requests.
    pub successes: u64,
}

/// How a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// A stop string matched.
    Stop,
    /// `max_tokens` was reached.
    Length,
}

impl Finish {
    /// The OpenAI `finish_reason` value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl EngineMetrics {
    /// Metrics labelled with the served model name and the engine's index in its process.
    pub(crate) fn new(config: &SimConfig, engine_index: usize) -> Self {
        let labels = format!(
            "engine=\"{engine_index}\",model_name=\"{}\"",
            escape_label(&config.model)
        );
        let cache_config_labels = format!(
            "block_size=\"{}\",enable_prefix_caching=\"{}\",num_gpu_blocks=\"{}\",max_num_seqs=\"{}\",max_num_batched_tokens=\"{}\"",
            config.block_size,
            if config.enable_prefix_caching {
                "True"
            } else {
                "False"
            },
            config.num_gpu_blocks,
            config.max_num_seqs,
            config.max_num_batched_tokens,
        );
        Self {
            labels,
            cache_config_labels,
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_usage_bits: AtomicU64::new(0f64.to_bits()),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            success_stop: AtomicU64::new(0),
            success_length: AtomicU64::new(0),
            kv_events_published: config.kv_events.endpoint.is_some(),
            kv_batches_sent: AtomicU64::new(0),
            kv_batches_lagged: AtomicU64::new(0),
            kv_batches_fault_dropped: AtomicU64::new(0),
            held_blocks: AtomicU64::new(0),
            holds_expired: AtomicU64::new(0),
            transfers_ok: AtomicU64::new(0),
            transfers_failed: AtomicU64::new(0),
            transfer_bytes: AtomicU64::new(0),
            transfer_micros: AtomicU64::new(0),
            transfers_in_flight: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            fine_itl: Histogram::new(FINE_ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }

    /// Sets the queue gauges and KV usage after an iteration.
    pub(crate) fn set_load(&self, running: usize, waiting: usize, kv_usage: f64) {
        self.running.store(running as u64, Ordering::Relaxed);
        self.waiting.store(waiting as u64, Ordering::Relaxed);
        self.kv_usage_bits
            .store(kv_usage.to_bits(), Ordering::Relaxed);
    }

    /// Records one prefix-cache lookup of `queried` tokens of which `hit` were cached.
    pub(crate) fn prefix_lookup(&self, queried: usize, hit: usize) {
        self.prefix_queries
            .fetch_add(queried as u64, Ordering::Relaxed);
        self.prefix_hits.fetch_add(hit as u64, Ordering::Relaxed);
    }

    /// Sets the blocks prefill legs hold for decode engines.
    pub(crate) fn set_held_blocks(&self, blocks: usize) {
        self.held_blocks.store(blocks as u64, Ordering::Relaxed);
    }

    /// Counts `n` holds freed unread.
    pub(crate) fn holds_expired(&self, n: usize) {
        self.holds_expired.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// A KV pull started (counted in flight until [`Self::transfer_done`] or
    /// [`Self::transfer_failed`]).
    pub(crate) fn transfer_started(&self) {
        self.transfers_in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A KV pull of `bytes` took `seconds`.
    pub(crate) fn transfer_done(&self, bytes: u64, seconds: f64) {
        self.transfers_in_flight.fetch_sub(1, Ordering::Relaxed);
        self.transfers_ok.fetch_add(1, Ordering::Relaxed);
        self.transfer_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.transfer_micros
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
    }

    /// A KV pull failed (the request prefills locally instead).
    pub(crate) fn transfer_failed(&self) {
        self.transfers_in_flight.fetch_sub(1, Ordering::Relaxed);
        self.transfers_failed.fetch_add(1, Ordering::Relaxed);
    }

    /// Records one preemption.
    pub(crate) fn preempted(&self) {
        self.preemptions.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a sequence's first token: its prompt tokens and time to first token.
    pub(crate) fn first_token(&self, prompt_tokens: usize, ttft_seconds: f64) {
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
        self.ttft.observe(ttft_seconds);
    }

    /// Records a later token and the gap since the previous one.
    pub(crate) fn next_token(&self, gap_seconds: f64) {
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
        self.itl.observe(gap_seconds);
        self.fine_itl.observe(gap_seconds);
    }

    /// Records a finished sequence.
    pub(crate) fn finished(&self, finish: Finish, e2e_seconds: f64) {
        match finish {
            Finish::Stop => self.success_stop.fetch_add(1, Ordering::Relaxed),
            Finish::Length => self.success_length.fetch_add(1, Ordering::Relaxed),
        };
        self.e2e.observe(e2e_seconds);
    }

    /// Records one KV event batch sent on the ZMQ PUB socket.
    pub(crate) fn kv_batch_sent(&self) {
        self.kv_batches_sent.fetch_add(1, Ordering::Relaxed);
    }

    /// Records `n` KV event batches the publisher missed because it fell behind the engine.
    pub(crate) fn kv_batches_lagged(&self, n: u64) {
        self.kv_batches_lagged.fetch_add(n, Ordering::Relaxed);
    }

    /// Records one KV event batch withheld by fault injection.
    pub(crate) fn kv_batch_fault_dropped(&self) {
        self.kv_batches_fault_dropped
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The main counters.
    #[cfg(test)]
    pub(crate) fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            prefix_queries: self.prefix_queries.load(Ordering::Relaxed),
            prefix_hits: self.prefix_hits.load(Ordering::Relaxed),
            preemptions: self.preemptions.load(Ordering::Relaxed),
            successes: self.success_stop.load(Ordering::Relaxed)
                + self.success_length.load(Ordering::Relaxed),
        }
    }

    /// Prometheus text exposition of every metric.
    pub(crate) fn render(&self) -> String {
        let l = &self.labels;
        let mut out = String::with_capacity(8192);
        let gauge = |out: &mut String, name: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{l}}} {value}"
            );
        };
        let counter = |out: &mut String, name: &str, help: &str, value: &AtomicU64| {
            let v = value.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{l}}} {v}"
            );
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            self.running.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            self.waiting.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed)).to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the KV cache configuration.\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{l},{}}} 1",
            self.cache_config_labels
        );
        counter(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            &self.prefix_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            &self.prefix_hits,
        );
        counter(
            &mut out,
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions from the engine.",
            &self.preemptions,
        );
        counter(
            &mut out,
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            &self.prompt_tokens,
        );
        counter(
            &mut out,
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            &self.generation_tokens,
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{{{l},finished_reason=\"length\"}} {}\nvllm:request_success_total{{{l},finished_reason=\"stop\"}} {}",
            self.success_length.load(Ordering::Relaxed),
            self.success_stop.load(Ordering::Relaxed),
        );
        self.ttft.render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            l,
        );
        self.itl.render(
            &mut out,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            l,
        );
        self.fine_itl.render(
            &mut out,
            "kvmesh_sim_inter_token_latency_seconds",
            "Inter-token latency in seconds, in 1 ms buckets to 60 ms (vLLM's histogram's are 25 ms apart there).",
            l,
        );
        self.e2e.render(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            l,
        );
        gauge(
            &mut out,
            "kvmesh_sim_kv_held_blocks",
            "KV blocks prefill legs hold for decode engines to read.",
            self.held_blocks.load(Ordering::Relaxed).to_string(),
        );
        counter(
            &mut out,
            "kvmesh_sim_kv_holds_expired_total",
            "Prefill legs whose blocks no decode engine read before the hold timeout.",
            &self.holds_expired,
        );
        let _ = writeln!(
            out,
            "# HELP kvmesh_sim_kv_transfers_total KV pulls from prefill engines, by outcome (failed: prefilled locally instead).\n\
             # TYPE kvmesh_sim_kv_transfers_total counter\n\
             kvmesh_sim_kv_transfers_total{{{l},outcome=\"ok\"}} {}\n\
             kvmesh_sim_kv_transfers_total{{{l},outcome=\"failed\"}} {}",
            self.transfers_ok.load(Ordering::Relaxed),
            self.transfers_failed.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kvmesh_sim_kv_transfer_bytes_total",
            "KV bytes pulled from prefill engines over the inbound link.",
            &self.transfer_bytes,
        );
        let _ = writeln!(
            out,
            "# HELP kvmesh_sim_kv_transfer_seconds_total Time KV pulls spent on the inbound link.\n\
             # TYPE kvmesh_sim_kv_transfer_seconds_total counter\n\
             kvmesh_sim_kv_transfer_seconds_total{{{l}}} {}",
            self.transfer_micros.load(Ordering::Relaxed) as f64 / 1e6,
        );
        gauge(
            &mut out,
            "kvmesh_sim_kv_transfers_in_flight",
            "KV pulls on the inbound link now.",
            self.transfers_in_flight.load(Ordering::Relaxed).to_string(),
        );
        if self.kv_events_published {
            counter(
                &mut out,
                "kvmesh_sim_kv_event_batches_sent_total",
                "KV event batches sent on the ZMQ PUB socket.",
                &self.kv_batches_sent,
            );
            counter(
                &mut out,
                "kvmesh_sim_kv_event_batches_lagged_total",
                "KV event batches lost because the publisher fell behind the engine (their sequence numbers are skipped).",
                &self.kv_batches_lagged,
            );
            counter(
                &mut out,
                "kvmesh_sim_kv_event_batches_fault_dropped_total",
                "KV event batches withheld from the PUB socket by fault injection (still replayable).",
                &self.kv_batches_fault_dropped,
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_with_labels() {
        let m = EngineMetrics::new(
            &SimConfig {
                model: "m\"x".into(),
                ..SimConfig::default()
            },
            2,
        );
        m.prefix_lookup(128, 64);
        m.first_token(128, 0.02);
        m.next_token(0.006);
        m.finished(Finish::Length, 0.5);
        m.set_load(3, 2, 0.25);
        let text = m.render();
        let l = "engine=\"2\",model_name=\"m\\\"x\"";
        for line in [
            format!("vllm:num_requests_running{{{l}}} 3"),
            format!("vllm:num_requests_waiting{{{l}}} 2"),
            format!("vllm:kv_cache_usage_perc{{{l}}} 0.25"),
            format!("vllm:prefix_cache_queries_total{{{l}}} 128"),
            format!("vllm:prefix_cache_hits_total{{{l}}} 64"),
            format!("vllm:num_preemptions_total{{{l}}} 0"),
            format!("vllm:prompt_tokens_total{{{l}}} 128"),
            format!("vllm:generation_tokens_total{{{l}}} 2"),
            format!("vllm:request_success_total{{{l},finished_reason=\"length\"}} 1"),
            format!("vllm:time_to_first_token_seconds_count{{{l}}} 1"),
            format!("vllm:inter_token_latency_seconds_count{{{l}}} 1"),
            format!("vllm:e2e_request_latency_seconds_count{{{l}}} 1"),
        ] {
            assert!(text.lines().any(|x| x == line), "missing {line} in\n{text}");
        }
        assert!(text.contains("block_size=\"16\""));
        assert!(!text.contains("kvmesh_sim_kv_event"));
        assert_eq!(m.snapshot().successes, 1);
    }
}

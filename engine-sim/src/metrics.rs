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
    external_queries: AtomicU64,
    external_hits: AtomicU64,
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
    requests_in_flight: AtomicU64,
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
    /// Prompt tokens past the device hit looked up in the host tier.
    pub external_queries: u64,
    /// Prompt tokens loaded from the host tier.
    pub external_hits: u64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Finished requests.
    pub successes: u64,
}

/// One engine core's load as the DP load balancer sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct BalancerLoad {
    /// Sequences submitted and not yet finished.
    pub in_flight: u64,
    /// `vllm:num_requests_waiting`.
    pub waiting: u64,
    /// `vllm:num_requests_running`.
    pub running: u64,
    /// `vllm:kv_cache_usage_perc`.
    pub kv_usage: f64,
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
            external_queries: AtomicU64::new(0),
            external_hits: AtomicU64::new(0),
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
            requests_in_flight: AtomicU64::new(0),
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

    /// Counts `n` sequences handed to this engine's scheduler (the DP load balancer's
    /// in-flight count, until [`Self::requests_left`]).
    pub(crate) fn requests_entered(&self, n: usize) {
        self.requests_in_flight
            .fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Counts `n` sequences that left the scheduler: finished, failed or cancelled.
    pub(crate) fn requests_left(&self, n: usize) {
        let _ = self
            .requests_in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n as u64))
            });
    }

    /// What vLLM's DP load balancer reads of an engine core: its in-flight sequences, the
    /// waiting and running gauges and KV usage.
    pub(crate) fn balancer_load(&self) -> BalancerLoad {
        BalancerLoad {
            in_flight: self.requests_in_flight.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            kv_usage: f64::from_bits(self.kv_usage_bits.load(Ordering::Relaxed)),
        }
    }

    /// Records one host-tier lookup of the `queried` tokens past the device hit, of which
    /// `hit` were loaded (vLLM's connector prefix-cache stats).
    pub(crate) fn external_prefix_lookup(&self, queried: usize, hit: usize) {
        self.external_queries
            .fetch_add(queried as u64, Ordering::Relaxed);
        self.external_hits.fetch_add(hit as u64, Ordering::Relaxed);
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
            external_queries: self.external_queries.load(Ordering::Relaxed),
            external_hits: self.external_hits.load(Ordering::Relaxed),
            preemptions: self.preemptions.load(Ordering::Relaxed),
            successes: self.success_stop.load(Ordering::Relaxed)
                + self.success_length.load(Ordering::Relaxed),
        }
    }

    /// Prometheus text exposition of every metric.
    #[cfg(test)]
    pub(crate) fn render(&self) -> String {
        Self::render_ranks(&[self])
    }

    /// Prometheus text exposition of every metric of an engine's data-parallel ranks: each
    /// family once, with one series per rank (its `engine` label), as vLLM exposes them.
    pub(crate) fn render_ranks(ranks: &[&EngineMetrics]) -> String {
        let mut out = String::with_capacity(8192 * ranks.len());
        let header = |out: &mut String, name: &str, help: &str, kind: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        let gauge =
            |out: &mut String, name: &str, help: &str, value: fn(&EngineMetrics) -> String| {
                header(out, name, help, "gauge");
                for m in ranks {
                    let _ = writeln!(out, "{name}{{{}}} {}", m.labels, value(m));
                }
            };
        let counter =
            |out: &mut String, name: &str, help: &str, value: fn(&EngineMetrics) -> &AtomicU64| {
                header(out, name, help, "counter");
                for m in ranks {
                    let v = value(m).load(Ordering::Relaxed);
                    let _ = writeln!(out, "{name}{{{}}} {v}", m.labels);
                }
            };
        let histogram =
            |out: &mut String, name: &str, help: &str, value: fn(&EngineMetrics) -> &Histogram| {
                Histogram::render_header(out, name, help);
                for m in ranks {
                    value(m).render_series(out, name, &m.labels);
                }
            };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            |m| m.running.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            |m| m.waiting.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            |m| f64::from_bits(m.kv_usage_bits.load(Ordering::Relaxed)).to_string(),
        );
        header(
            &mut out,
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            "gauge",
        );
        for m in ranks {
            let _ = writeln!(
                out,
                "vllm:cache_config_info{{{},{}}} 1",
                m.labels, m.cache_config_labels
            );
        }
        counter(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            |m| &m.prefix_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            |m| &m.prefix_hits,
        );
        counter(
            &mut out,
            "vllm:external_prefix_cache_queries_total",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
            |m| &m.external_queries,
        );
        counter(
            &mut out,
            "vllm:external_prefix_cache_hits_total",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
            |m| &m.external_hits,
        );
        counter(
            &mut out,
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions from the engine.",
            |m| &m.preemptions,
        );
        counter(
            &mut out,
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            |m| &m.prompt_tokens,
        );
        counter(
            &mut out,
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            |m| &m.generation_tokens,
        );
        header(
            &mut out,
            "vllm:request_success_total",
            "Count of successfully processed requests.",
            "counter",
        );
        for m in ranks {
            let l = &m.labels;
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{l},finished_reason=\"length\"}} {}\nvllm:request_success_total{{{l},finished_reason=\"stop\"}} {}",
                m.success_length.load(Ordering::Relaxed),
                m.success_stop.load(Ordering::Relaxed),
            );
        }
        histogram(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            |m| &m.ttft,
        );
        histogram(
            &mut out,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            |m| &m.itl,
        );
        histogram(
            &mut out,
            "kvmesh_sim_inter_token_latency_seconds",
            "Inter-token latency in seconds, in 1 ms buckets to 60 ms (vLLM's histogram's are 25 ms apart there).",
            |m| &m.fine_itl,
        );
        histogram(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            |m| &m.e2e,
        );
        gauge(
            &mut out,
            "kvmesh_sim_kv_held_blocks",
            "KV blocks prefill legs hold for decode engines to read.",
            |m| m.held_blocks.load(Ordering::Relaxed).to_string(),
        );
        counter(
            &mut out,
            "kvmesh_sim_kv_holds_expired_total",
            "Prefill legs whose blocks no decode engine read before the hold timeout.",
            |m| &m.holds_expired,
        );
        header(
            &mut out,
            "kvmesh_sim_kv_transfers_total",
            "KV pulls from prefill engines, by outcome (failed: prefilled locally instead).",
            "counter",
        );
        for m in ranks {
            let l = &m.labels;
            let _ = writeln!(
                out,
                "kvmesh_sim_kv_transfers_total{{{l},outcome=\"ok\"}} {}\n\
                 kvmesh_sim_kv_transfers_total{{{l},outcome=\"failed\"}} {}",
                m.transfers_ok.load(Ordering::Relaxed),
                m.transfers_failed.load(Ordering::Relaxed),
            );
        }
        counter(
            &mut out,
            "kvmesh_sim_kv_transfer_bytes_total",
            "KV bytes pulled from prefill engines over the inbound link.",
            |m| &m.transfer_bytes,
        );
        header(
            &mut out,
            "kvmesh_sim_kv_transfer_seconds_total",
            "Time KV pulls spent on the inbound link.",
            "counter",
        );
        for m in ranks {
            let _ = writeln!(
                out,
                "kvmesh_sim_kv_transfer_seconds_total{{{}}} {}",
                m.labels,
                m.transfer_micros.load(Ordering::Relaxed) as f64 / 1e6,
            );
        }
        gauge(
            &mut out,
            "kvmesh_sim_kv_transfers_in_flight",
            "KV pulls on the inbound link now.",
            |m| m.transfers_in_flight.load(Ordering::Relaxed).to_string(),
        );
        if ranks.first().is_some_and(|m| m.kv_events_published) {
            counter(
                &mut out,
                "kvmesh_sim_kv_event_batches_sent_total",
                "KV event batches sent on the ZMQ PUB socket.",
                |m| &m.kv_batches_sent,
            );
            counter(
                &mut out,
                "kvmesh_sim_kv_event_batches_lagged_total",
                "KV event batches lost because the publisher fell behind the engine (their sequence numbers are skipped).",
                |m| &m.kv_batches_lagged,
            );
            counter(
                &mut out,
                "kvmesh_sim_kv_event_batches_fault_dropped_total",
                "KV event batches withheld from the PUB socket by fault injection (still replayable).",
                |m| &m.kv_batches_fault_dropped,
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
        m.external_prefix_lookup(64, 32);
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
            format!("vllm:external_prefix_cache_queries_total{{{l}}} 64"),
            format!("vllm:external_prefix_cache_hits_total{{{l}}} 32"),
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

    #[test]
    fn ranks_share_each_family_with_a_series_each() {
        let config = SimConfig::default();
        let (a, b) = (
            EngineMetrics::new(&config, 0),
            EngineMetrics::new(&config, 1),
        );
        a.set_load(2, 0, 0.5);
        b.prefix_lookup(64, 32);
        b.finished(Finish::Stop, 0.1);
        let text = EngineMetrics::render_ranks(&[&a, &b]);
        for line in [
            "vllm:num_requests_running{engine=\"0\",model_name=\"sim-model\"} 2",
            "vllm:num_requests_running{engine=\"1\",model_name=\"sim-model\"} 0",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"sim-model\"} 0",
            "vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"sim-model\"} 32",
            "vllm:request_success_total{engine=\"1\",model_name=\"sim-model\",finished_reason=\"stop\"} 1",
            "vllm:e2e_request_latency_seconds_count{engine=\"1\",model_name=\"sim-model\"} 1",
        ] {
            assert!(text.lines().any(|x| x == line), "missing {line} in\n{text}");
        }
        // One HELP and TYPE per family (a Prometheus parser refuses a family declared twice).
        let types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let mut unique = types.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(types.len(), unique.len(), "{text}");
        assert_eq!(
            text.lines().filter(|l| l.starts_with("# TYPE ")).count(),
            a.render()
                .lines()
                .filter(|l| l.starts_with("# TYPE "))
                .count()
        );
        // A family's series follow its header, rank by rank.
        let running: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("# TYPE vllm:num_requests_running"))
            .skip(1)
            .take(2)
            .collect();
        assert!(
            running
                .iter()
                .all(|l| l.starts_with("vllm:num_requests_running{"))
        );
    }

    #[test]
    fn the_balancer_reads_in_flight_sequences_and_the_gauges() {
        let m = EngineMetrics::new(&SimConfig::default(), 0);
        m.requests_entered(3);
        m.requests_left(1);
        m.set_load(1, 1, 0.75);
        assert_eq!(
            m.balancer_load(),
            BalancerLoad {
                in_flight: 2,
                waiting: 1,
                running: 1,
                kv_usage: 0.75
            }
        );
        m.requests_left(5);
        assert_eq!(m.balancer_load().in_flight, 0, "never below zero");
    }
}

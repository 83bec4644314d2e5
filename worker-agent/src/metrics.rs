//! The agent's Prometheus metrics (`GET /metrics` on its listener).

use kvmesh_telemetry::SpanCounters;
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::sidecar::pacer::PacerMetrics;

/// Every metric the agent exports, prefix `kvmesh_agent_`.
#[derive(Debug, Clone)]
pub struct AgentMetrics {
    registry: Registry,
    /// `kvmesh_agent_events_received_total`: engine KV events decoded (ignored ones included).
    pub events_received: IntCounter,
    /// `kvmesh_agent_events_published_total`: kvmesh KV events published.
    pub events_published: IntCounter,
    /// `kvmesh_agent_batches_published_total`: event batches published (one `seq` each).
    pub batches_published: IntCounter,
    /// `kvmesh_agent_blocks_published_total`: blocks named by published events.
    pub blocks_published: IntCounter,
    /// `kvmesh_agent_dropped_total{reason}`: engine events or batches not published, by reason
    /// (`kv_group`, `medium`, `offload`, `unknown_type`, `block_size`, `token_count`,
    /// `malformed_event`, `publish_queue`, `publish_failed`, `snapshot_too_large`).
    pub dropped: IntCounterVec,
    /// `kvmesh_agent_malformed_total`: engine messages that could not be decoded at all.
    pub malformed: IntCounter,
    /// `kvmesh_agent_translation_misses_total`: blocks that could not be translated (stored
    /// under an unknown parent) or removed without being known.
    pub translation_misses: IntCounter,
    /// `kvmesh_agent_publish_seconds`: from receiving an engine message to handing its batch
    /// to the bus.
    pub publish_seconds: Histogram,
    /// `kvmesh_agent_engine_seq_gaps_total`: gaps in the engine's sequence numbers.
    pub engine_seq_gaps: IntCounter,
    /// `kvmesh_agent_replays_total{result}`: replay requests to the engine (`ok`,
    /// `incomplete`, `failed`).
    pub replays: IntCounterVec,
    /// `kvmesh_agent_resync_requests_total{kind}`: resync requests answered (`events`,
    /// `snapshot`, `invalid`).
    pub resync_requests: IntCounterVec,
    /// `kvmesh_agent_cached_blocks`: engine blocks the agent knows as cached in device memory.
    pub cached_blocks: IntGauge,
    /// `kvmesh_agent_offloaded_blocks{tier}`: engine blocks it knows in host memory or on disk.
    pub offloaded_blocks: IntGaugeVec,
    /// `kvmesh_agent_registered`: 1 while the instance record is in the registry.
    pub registered: IntGauge,
    /// `kvmesh_agent_engine_healthy`: 1 while the engine's `/health` answers 200.
    pub engine_healthy: IntGauge,
    /// `kvmesh_agent_adapters`: LoRA adapters the engine's `/v1/models` lists.
    pub adapters: IntGauge,
    /// `kvmesh_agent_load_reports_total{result}`: engine `/metrics` scrapes (`ok`, `error`).
    pub load_reports: IntCounterVec,
    /// `kvmesh_agent_engine_running_requests`: the running requests of the last load report.
    pub engine_running: IntGauge,
    /// `kvmesh_agent_engine_waiting_requests`: the waiting requests of the last load report.
    pub engine_waiting: IntGauge,
    /// `kvmesh_agent_kv_events_complete`: 1 while the agent's view of the engine's cache is
    /// whole, 0 once events were lost that no replay restored (until the engine clears its
    /// cache or restarts); the load reports carry it to the proxies.
    pub events_complete: IntGauge,
    /// `kvmesh_agent_inbound_requests_total{outcome}`: requests through the inbound sidecar
    /// (`forwarded`, `engine_unreachable`, `bad_request`).
    pub inbound_requests: IntCounterVec,
    /// The KV-transfer pacer's: `kvmesh_agent_kv_transfer_bytes_in_flight`,
    /// `kvmesh_agent_kv_transfers_queued`, `kvmesh_agent_kv_transfer_wait_seconds`,
    /// `kvmesh_agent_kv_transfers_admitted_total`.
    pub pacer: PacerMetrics,
    /// `kvmesh_agent_trace_spans_exported_total` and
    /// `kvmesh_agent_trace_spans_dropped_total{reason}` (0 while tracing is off).
    pub trace_spans: SpanCounters,
}

fn counter(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let c = IntCounter::new(name, help)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    label: &str,
) -> prometheus::Result<IntCounterVec> {
    let v = IntCounterVec::new(Opts::new(name, help), &[label])?;
    registry.register(Box::new(v.clone()))?;
    Ok(v)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    let g = IntGauge::new(name, help)?;
    registry.register(Box::new(g.clone()))?;
    Ok(g)
}

/// Buckets of `kvmesh_agent_publish_seconds`: 50 µs to 1 s.
const PUBLISH_BUCKETS: [f64; 13] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

impl AgentMetrics {
    /// Fresh metrics in their own registry (fails only on an invalid constant name).
    pub fn new() -> prometheus::Result<Self> {
        let r = Registry::new();
        let publish_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvmesh_agent_publish_seconds",
                "Time from receiving an engine KV event message to handing its batch to the bus",
            )
            .buckets(PUBLISH_BUCKETS.to_vec()),
        )?;
        r.register(Box::new(publish_seconds.clone()))?;
        let wait_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvmesh_agent_kv_transfer_wait_seconds",
                "Time decode legs waited for the pod's KV-transfer budget",
            )
            .buckets(vec![
                0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ]),
        )?;
        r.register(Box::new(wait_seconds.clone()))?;
        let pacer = PacerMetrics {
            in_flight_bytes: gauge(
                &r,
                "kvmesh_agent_kv_transfer_bytes_in_flight",
                "KV bytes of admitted decode-leg transfers not done yet (no first token, and not yet their bytes at the paced rate)",
            )?,
            queued: gauge(
                &r,
                "kvmesh_agent_kv_transfers_queued",
                "Decode legs waiting for the KV-transfer budget",
            )?,
            wait_seconds,
            admitted: counter(
                &r,
                "kvmesh_agent_kv_transfers_admitted_total",
                "Decode legs admitted into the KV-transfer budget",
            )?,
            rate_bytes_per_second: gauge(
                &r,
                "kvmesh_agent_kv_transfer_rate_bytes_per_second",
                "The rate decode-leg transfers are paced at: --pace-rate-gbps, else the GPUs' slowest measured host-to-device bandwidth (cuda feature), else 25 GB/s (0 while pacing is off)",
            )?,
        };
        Ok(Self {
            events_received: counter(
                &r,
                "kvmesh_agent_events_received_total",
                "Engine KV events decoded",
            )?,
            events_published: counter(
                &r,
                "kvmesh_agent_events_published_total",
                "kvmesh KV events published",
            )?,
            batches_published: counter(
                &r,
                "kvmesh_agent_batches_published_total",
                "KV event batches published",
            )?,
            blocks_published: counter(
                &r,
                "kvmesh_agent_blocks_published_total",
                "Blocks named by published KV events",
            )?,
            dropped: counter_vec(
                &r,
                "kvmesh_agent_dropped_total",
                "Engine events or batches not published, by reason",
                "reason",
            )?,
            malformed: counter(
                &r,
                "kvmesh_agent_malformed_total",
                "Engine KV event messages that could not be decoded",
            )?,
            translation_misses: counter(
                &r,
                "kvmesh_agent_translation_misses_total",
                "Blocks stored under an unknown parent or removed without being known",
            )?,
            publish_seconds,
            engine_seq_gaps: counter(
                &r,
                "kvmesh_agent_engine_seq_gaps_total",
                "Gaps in the engine's KV event sequence numbers",
            )?,
            replays: counter_vec(
                &r,
                "kvmesh_agent_replays_total",
                "Replay requests to the engine, by result",
                "result",
            )?,
            resync_requests: counter_vec(
                &r,
                "kvmesh_agent_resync_requests_total",
                "Resync requests answered, by kind",
                "kind",
            )?,
            cached_blocks: gauge(
                &r,
                "kvmesh_agent_cached_blocks",
                "Engine blocks the agent knows as cached in device memory",
            )?,
            offloaded_blocks: {
                let v = IntGaugeVec::new(
                    Opts::new(
                        "kvmesh_agent_offloaded_blocks",
                        "Engine blocks the agent knows as kept in a lower tier (host memory, disk)",
                    ),
                    &["tier"],
                )?;
                r.register(Box::new(v.clone()))?;
                for tier in ["host", "disk"] {
                    v.with_label_values(&[tier]);
                }
                v
            },
            registered: gauge(
                &r,
                "kvmesh_agent_registered",
                "1 while the instance record is registered",
            )?,
            engine_healthy: gauge(
                &r,
                "kvmesh_agent_engine_healthy",
                "1 while the engine's /health answers 200",
            )?,
            adapters: gauge(
                &r,
                "kvmesh_agent_adapters",
                "LoRA adapters the engine's /v1/models lists",
            )?,
            engine_running: gauge(
                &r,
                "kvmesh_agent_engine_running_requests",
                "Running requests in the last load report",
            )?,
            engine_waiting: gauge(
                &r,
                "kvmesh_agent_engine_waiting_requests",
                "Waiting requests in the last load report",
            )?,
            events_complete: {
                let whole = gauge(
                    &r,
                    "kvmesh_agent_kv_events_complete",
                    "1 while the agent's view of the engine's KV cache is whole, 0 once KV events were lost that no replay restored",
                )?;
                whole.set(1);
                whole
            },
            load_reports: counter_vec(
                &r,
                "kvmesh_agent_load_reports_total",
                "Engine /metrics scrapes, by result",
                "result",
            )?,
            inbound_requests: counter_vec(
                &r,
                "kvmesh_agent_inbound_requests_total",
                "Requests through the inbound sidecar, by outcome",
                "outcome",
            )?,
            pacer,
            trace_spans: SpanCounters::register(&r, "kvmesh_agent")?,
            registry: r,
        })
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding counters, gauges and histograms into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_exported() {
        let m = AgentMetrics::new().expect("valid metrics");
        m.dropped.with_label_values(&["kv_group"]).inc();
        m.replays.with_label_values(&["ok"]).inc();
        m.resync_requests.with_label_values(&["snapshot"]).inc();
        m.load_reports.with_label_values(&["ok"]).inc();
        m.publish_seconds.observe(0.001);
        let text = m.render();
        for name in [
            "kvmesh_agent_events_received_total",
            "kvmesh_agent_events_published_total",
            "kvmesh_agent_batches_published_total",
            "kvmesh_agent_blocks_published_total",
            "kvmesh_agent_dropped_total{reason=\"kv_group\"} 1",
            "kvmesh_agent_malformed_total",
            "kvmesh_agent_translation_misses_total",
            "kvmesh_agent_publish_seconds_bucket",
            "kvmesh_agent_engine_seq_gaps_total",
            "kvmesh_agent_replays_total{result=\"ok\"} 1",
            "kvmesh_agent_resync_requests_total",
            "kvmesh_agent_cached_blocks",
            "kvmesh_agent_offloaded_blocks{tier=\"host\"} 0",
            "kvmesh_agent_registered",
            "kvmesh_agent_engine_healthy",
            "kvmesh_agent_adapters",
            "kvmesh_agent_load_reports_total",
            "kvmesh_agent_engine_running_requests",
            "kvmesh_agent_engine_waiting_requests",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
    }
}

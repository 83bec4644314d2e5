//! Load reports: the engine's `/metrics` scraped every interval into a [`LoadReport`] on the
//! model's load subject.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvmesh_control::{EventBus, InstanceId, LoadReport};
use kvmesh_wire::engine_load::{self, LoadGauges, read_load};

use crate::config::EngineKind;
use crate::core::Core;
use crate::http_client::EngineClient;
use crate::metrics::AgentMetrics;

/// The metrics one engine kind states its load in.
fn gauges(kind: EngineKind) -> LoadGauges<'static> {
    match kind {
        EngineKind::Vllm => engine_load::VLLM,
        EngineKind::Sglang => engine_load::SGLANG,
        EngineKind::Trtllm => engine_load::TRTLLM,
    }
}

/// Where the engine's Prometheus metrics are: trtllm-serve serves them at
/// `/prometheus/metrics` (its `/metrics` is iteration stats in JSON), and only with
/// `return_perf_metrics: true` in its LLM API options.
pub(crate) fn metrics_path(kind: EngineKind) -> &'static str {
    match kind {
        EngineKind::Vllm | EngineKind::Sglang => "/metrics",
        EngineKind::Trtllm => "/prometheus/metrics",
    }
}

/// Builds a load report from an exposition, as [`read_load`] reads the gauges of `kind`:
/// `None` when the running / waiting gauges are missing or not finite numbers. Running and
/// waiting are summed over label sets (data-parallel engines), KV usage averaged.
pub fn parse_load(
    kind: EngineKind,
    text: &str,
    instance_id: InstanceId,
    at_ms: u64,
) -> Option<LoadReport> {
    let load = read_load(text, &gauges(kind))?;
    Some(LoadReport {
        instance_id,
        running: load.running,
        waiting: load.waiting,
        kv_usage: load.kv_usage,
        at_ms,
        age_ms: None,
        events_complete: true,
        last_seq: None,
    })
}

/// Scrapes and publishes until aborted: the load of `core`'s instance, with the last batch
/// number `core` issued.
pub(crate) async fn run(
    engine: EngineClient,
    kind: EngineKind,
    bus: Arc<dyn EventBus>,
    subject: String,
    interval: Duration,
    metrics: AgentMetrics,
    core: Arc<Core>,
) {
    let instance_id = core.instance_id();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = interval.max(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let scraped = Instant::now();
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default();
        let report = match engine.get(metrics_path(kind), timeout).await {
            Ok((status, body)) if status.is_success() => {
                parse_load(kind, &String::from_utf8_lossy(&body), instance_id, at_ms)
            }
            Ok((status, _)) => {
                tracing::debug!(%status, "engine /metrics answered an error");
                None
            }
            Err(why) => {
                tracing::debug!(%why, "cannot scrape engine /metrics");
                None
            }
        };
        let Some(mut report) = report else {
            metrics.load_reports.with_label_values(&["error"]).inc();
            continue;
        };
        report.events_complete = metrics.events_complete.get() == 1;
        report.last_seq = Some(core.last_seq());
        report.age_ms = Some(u64::try_from(scraped.elapsed().as_millis()).unwrap_or(u64::MAX));
        metrics.load_reports.with_label_values(&["ok"]).inc();
        metrics
            .engine_running
            .set(i64::try_from(report.running).unwrap_or(i64::MAX));
        metrics
            .engine_waiting
            .set(i64::try_from(report.waiting).unwrap_or(i64::MAX));
        if let Err(e) = bus.publish(&subject, Bytes::from(report.to_json())).await {
            tracing::debug!(error = %e, "cannot publish a load report");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_sglang_names_are_read() {
        let id = InstanceId(7);
        let vllm = "vllm:num_requests_running 3\nvllm:num_requests_waiting 2\nvllm:gpu_cache_usage_perc 0.4\n";
        let r = parse_load(EngineKind::Vllm, vllm, id, 5).expect("vllm report");
        assert_eq!((r.running, r.waiting, r.kv_usage, r.at_ms), (3, 2, 0.4, 5));
        let sglang =
            "sglang:num_running_reqs{x=\"1\"} 1\nsglang:num_queue_reqs 0\nsglang:token_usage 0.9\n";
        let r = parse_load(EngineKind::Sglang, sglang, id, 0).expect("sglang report");
        assert_eq!((r.running, r.waiting, r.kv_usage), (1, 0, 0.9));
        assert!(parse_load(EngineKind::Vllm, sglang, id, 0).is_none());
    }

    #[test]
    fn a_usage_that_is_not_a_number_still_makes_a_report_the_proxy_reads() {
        // A NaN usage was written as `"kv_usage":null`, which `LoadReport::from_json` refuses.
        let text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc NaN\n";
        let report = parse_load(EngineKind::Vllm, text, InstanceId(7), 5).expect("report");
        assert_eq!(LoadReport::from_json(&report.to_json()).ok(), Some(report));
        assert_eq!(report.kv_usage, 0.0);
    }

    #[test]
    fn trtllm_names_are_read_from_its_prometheus_page() {
        // prometheus_client's multiprocess rendering of trtllm-serve's gauges.
        let page = "# HELP trtllm_num_requests_running Number of active requests
            # TYPE trtllm_num_requests_running gauge
            trtllm_num_requests_running{engine_type=\"undefined\",model_name=\"undefined\"} 3.0
            trtllm_num_requests_waiting{engine_type=\"undefined\",model_name=\"undefined\"} 1.0
            trtllm_kv_cache_utilization{engine_type=\"undefined\",model_name=\"undefined\"} 0.25
";
        let r = parse_load(EngineKind::Trtllm, page, InstanceId(7), 0).expect("trtllm report");
        assert_eq!((r.running, r.waiting, r.kv_usage), (3, 1, 0.25));
        assert_eq!(metrics_path(EngineKind::Trtllm), "/prometheus/metrics");
        assert!(parse_load(EngineKind::Vllm, page, InstanceId(7), 0).is_none());
    }
}

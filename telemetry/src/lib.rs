//! kvmesh-telemetry: OpenTelemetry tracing for the proxy and the agent.
//!
//! - [`Telemetry::start`] builds a tracer whose spans go, in batches, to an OTLP/gRPC
//!   receiver (the `opentelemetry-otlp` tonic exporter), sampled parent-based with a trace-id
//!   ratio for new traces. Finished spans wait in a bounded queue that a task on the tokio
//!   runtime drains: ending a span never waits for the network, and an unreachable receiver
//!   drops spans (counted in [`SpanCounters`], logged once per outage) instead of slowing
//!   anything down. [`Telemetry::shutdown`] exports what is still queued.
//! - [`traceparent`] reads and writes W3C `traceparent` / `tracestate`.
//!
//! Tracing off is the absence of a [`Telemetry`]: callers keep an `Option` of its
//! [`Tracer`], and nothing here runs.
//!
//! The exporter is the default cargo feature `otlp`; without it only [`traceparent`] and the
//! settings types remain, which is how the fuzz targets build the crate (fuzz/,
//! docs/fuzzing.md).

#[cfg(feature = "otlp")]
mod export;
pub mod traceparent;

use std::time::Duration;

#[cfg(feature = "otlp")]
use opentelemetry::KeyValue;
#[cfg(feature = "otlp")]
use opentelemetry::trace::TracerProvider as _;
#[cfg(feature = "otlp")]
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
#[cfg(feature = "otlp")]
use opentelemetry_sdk::Resource;
#[cfg(feature = "otlp")]
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanExporter as _};

#[cfg(feature = "otlp")]
pub use export::SpanCounters;
#[cfg(feature = "otlp")]
use export::{Batching, ExportTask};

/// The tracer spans are started from (cheap to clone).
#[cfg(feature = "otlp")]
pub type Tracer = opentelemetry_sdk::trace::SdkTracer;

/// Spans per export at most.
#[cfg(feature = "otlp")]
const BATCH_SIZE: usize = 512;

/// Where spans go and which are kept.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// The OTLP/gRPC receiver, `http://host:port` (plaintext).
    pub otlp_endpoint: String,
    /// Share of new traces recorded (0 to 1); a request with a `traceparent` follows its
    /// sampled flag instead.
    pub sampling_ratio: f64,
    /// `service.name` of the spans.
    pub service_name: String,
    /// Longest a finished span waits before it is exported.
    pub export_interval: Duration,
    /// Longest one export may take (its spans are dropped after it).
    pub export_timeout: Duration,
    /// Finished spans waiting for export at most; more are dropped.
    pub max_queue_size: usize,
}

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter rejected its settings (e.g. the endpoint).
    #[error("the OTLP exporter for {endpoint}: {reason}")]
    Exporter {
        /// The endpoint given.
        endpoint: String,
        /// What the exporter said.
        reason: String,
    },
}

/// Tracing that runs: the provider and its export task.
#[cfg(feature = "otlp")]
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    task: ExportTask,
    export_timeout: Duration,
}

#[cfg(feature = "otlp")]
impl Telemetry {
    /// Starts exporting to `settings.otlp_endpoint` (nothing connects until the first
    /// export). `attributes` describe the process beside `service.name` and
    /// `service.version`; `counters` count the exported and dropped spans. Must be called
    /// inside a tokio runtime, which runs the export task.
    pub fn start(
        settings: &TraceSettings,
        attributes: Vec<KeyValue>,
        counters: SpanCounters,
    ) -> Result<Self, TelemetryError> {
        let mut exporter = SpanExporter::builder()
            .with_tonic()
            .with_endpoint(settings.otlp_endpoint.clone())
            .with_timeout(settings.export_timeout)
            .build()
            .map_err(|error| TelemetryError::Exporter {
                endpoint: settings.otlp_endpoint.clone(),
                reason: error.to_string(),
            })?;
        let resource = Resource::builder()
            .with_service_name(settings.service_name.clone())
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .with_attributes(attributes)
            .build();
        exporter.set_resource(&resource);
        let batching = Batching {
            queue_size: settings.max_queue_size,
            batch_size: BATCH_SIZE.min(settings.max_queue_size.max(1)),
            interval: settings.export_interval,
            timeout: settings.export_timeout,
        };
        let (queue, task) = export::start(exporter, batching, counters);
        let provider = SdkTracerProvider::builder()
            .with_sampler(sampler(settings.sampling_ratio))
            .with_resource(resource)
            .with_span_processor(queue)
            .build();
        tracing::info!(
            endpoint = %settings.otlp_endpoint,
            sampling_ratio = settings.sampling_ratio,
            "tracing: exporting spans over OTLP/gRPC"
        );
        Ok(Self {
            provider,
            task,
            export_timeout: settings.export_timeout,
        })
    }

    /// The tracer of the component `scope` (instrumentation scope name).
    pub fn tracer(&self, scope: &'static str) -> Tracer {
        self.provider.tracer(scope)
    }

    /// Exports the spans still queued (waiting up to twice the export timeout) and stops.
    /// Spans ended later are dropped.
    pub async fn shutdown(self) {
        if !self.task.finish(self.export_timeout * 2).await {
            tracing::warn!("tracing: the last spans were not exported in time");
        }
        // The processor holds nothing: this only marks the provider shut down.
        let _ = self.provider.shutdown();
    }
}

/// Parent-based: a remote or local parent's sampled flag decides; a new trace is kept
/// with probability `ratio` (by its trace id, so every process keeps the same traces).
#[cfg(feature = "otlp")]
fn sampler(ratio: f64) -> Sampler {
    Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))
}

#[cfg(all(test, feature = "otlp"))]
mod tests {
    use opentelemetry::Context;
    use opentelemetry::trace::{SpanContext, SpanKind, TraceContextExt, TraceId, TraceState};
    use opentelemetry_sdk::trace::{SamplingDecision, ShouldSample};

    use super::*;

    fn decide(sampler: &Sampler, parent: Option<&str>, trace_id: TraceId) -> SamplingDecision {
        let cx = match parent.and_then(|value| traceparent::parse(value, None)) {
            Some(remote) => Context::new().with_remote_span_context(remote),
            None => Context::new(),
        };
        sampler
            .should_sample(Some(&cx), trace_id, "span", &SpanKind::Server, &[], &[])
            .decision
    }

    const SAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const UNSAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";

    #[test]
    fn a_parent_decides_over_the_ratio() {
        let id = TraceId::from_bytes([0xff; 16]);
        let never = sampler(0.0);
        assert_eq!(
            decide(&never, Some(SAMPLED), id),
            SamplingDecision::RecordAndSample
        );
        assert_eq!(decide(&never, None, id), SamplingDecision::Drop);
        let always = sampler(1.0);
        assert_eq!(decide(&always, Some(UNSAMPLED), id), SamplingDecision::Drop);
        assert_eq!(decide(&always, None, id), SamplingDecision::RecordAndSample);
    }

    #[test]
    fn the_ratio_keeps_about_its_share_of_new_traces() {
        let half = sampler(0.5);
        let kept = (0..10_000u128)
            .map(|i| TraceId::from(i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)))
            .filter(|&id| decide(&half, None, id) == SamplingDecision::RecordAndSample)
            .count();
        assert!((4_500..=5_500).contains(&kept), "kept {kept} of 10000");
    }

    #[test]
    fn a_local_parent_passes_its_decision_to_children() {
        let child_of = |sampled: bool| {
            let parent = SpanContext::new(
                TraceId::from_bytes([7; 16]),
                opentelemetry::trace::SpanId::from_bytes([1; 8]),
                if sampled {
                    opentelemetry::trace::TraceFlags::SAMPLED
                } else {
                    opentelemetry::trace::TraceFlags::default()
                },
                false,
                TraceState::default(),
            );
            let cx = Context::new().with_remote_span_context(parent);
            sampler(0.5)
                .should_sample(
                    Some(&cx),
                    TraceId::from_bytes([7; 16]),
                    "child",
                    &SpanKind::Internal,
                    &[],
                    &[],
                )
                .decision
        };
        assert_eq!(child_of(true), SamplingDecision::RecordAndSample);
        assert_eq!(child_of(false), SamplingDecision::Drop);
    }
}

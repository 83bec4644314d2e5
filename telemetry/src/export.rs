//! The way out for finished spans: a bounded queue that the span's end never waits on, and a
//! task on the tokio runtime that exports its spans in batches. A full queue or a failed
//! export drops spans, counted in [`SpanCounters`]; the first failure of a run of failures is
//! logged at `warn`, the recovery at `info`.

use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use tokio::sync::{mpsc, oneshot};
use tokio::time::{MissedTickBehavior, interval, timeout};

/// Counts of the spans that left the process, and of those dropped on the way.
#[derive(Debug, Clone)]
pub struct SpanCounters {
    exported: IntCounter,
    queue_full: IntCounter,
    export_failed: IntCounter,
}

impl SpanCounters {
    /// Creates `{prefix}_trace_spans_exported_total` and
    /// `{prefix}_trace_spans_dropped_total{reason}` (`queue_full`, `export_failed`) and
    /// registers them in `registry`.
    pub fn register(registry: &Registry, prefix: &str) -> prometheus::Result<Self> {
        let exported = IntCounter::new(
            format!("{prefix}_trace_spans_exported_total"),
            "Spans accepted by the OTLP receiver.",
        )?;
        let dropped = IntCounterVec::new(
            Opts::new(
                format!("{prefix}_trace_spans_dropped_total"),
                "Spans dropped, by reason: queue_full (the export queue was full), \
                 export_failed (the OTLP receiver failed, was unreachable or too slow).",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(exported.clone()))?;
        registry.register(Box::new(dropped.clone()))?;
        Ok(Self {
            exported,
            queue_full: dropped.with_label_values(&["queue_full"]),
            export_failed: dropped.with_label_values(&["export_failed"]),
        })
    }

    /// Spans exported so far.
    pub fn exported(&self) -> u64 {
        self.exported.get()
    }

    /// Spans dropped so far (all reasons).
    pub fn dropped(&self) -> u64 {
        self.queue_full.get() + self.export_failed.get()
    }
}

/// How spans are batched.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Batching {
    /// Spans waiting at most; more are dropped.
    pub(crate) queue_size: usize,
    /// Spans per export at most.
    pub(crate) batch_size: usize,
    /// Longest wait before the spans waiting are exported.
    pub(crate) interval: Duration,
    /// Longest one export may take.
    pub(crate) timeout: Duration,
}

/// The span processor: hands each finished span to the export task, never waiting.
#[derive(Debug)]
pub(crate) struct ExportQueue {
    spans: mpsc::Sender<SpanData>,
    counters: SpanCounters,
}

impl SpanProcessor for ExportQueue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if self.spans.try_send(span).is_err() {
            self.counters.queue_full.inc();
        }
    }

    /// The queue is flushed by [`crate::Telemetry::shutdown`] (asynchronously, on the
    /// runtime); a blocking flush here could stall the thread the export task needs.
    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// The export task's handle: stop it and wait for its last export.
#[derive(Debug)]
pub(crate) struct ExportTask {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl ExportTask {
    /// Asks the task to export what is queued and waits up to `deadline` for it.
    pub(crate) async fn finish(self, deadline: Duration) -> bool {
        let _ = self.stop.send(());
        let mut task = self.task;
        match timeout(deadline, &mut task).await {
            Ok(_) => true,
            Err(_) => {
                task.abort();
                false
            }
        }
    }
}

/// The processor and the export task (spawned on the current runtime) of `exporter`.
pub(crate) fn start<E: SpanExporter + 'static>(
    exporter: E,
    batching: Batching,
    counters: SpanCounters,
) -> (ExportQueue, ExportTask) {
    let (spans, queued) = mpsc::channel(batching.queue_size.max(1));
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(export_loop(
        exporter,
        queued,
        stopped,
        batching,
        counters.clone(),
    ));
    (ExportQueue { spans, counters }, ExportTask { stop, task })
}

/// Exports batches until stopped, then what is still queued.
async fn export_loop<E: SpanExporter>(
    exporter: E,
    mut queued: mpsc::Receiver<SpanData>,
    mut stop: oneshot::Receiver<()>,
    batching: Batching,
    counters: SpanCounters,
) {
    let mut outcome = Outcome::default();
    let mut batch = Vec::with_capacity(batching.batch_size);
    let mut tick = interval(batching.interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let room = batching.batch_size - batch.len();
        tokio::select! {
            biased;
            _ = &mut stop => break,
            received = queued.recv_many(&mut batch, room) => {
                if received == 0 {
                    break;
                }
                if batch.len() < batching.batch_size {
                    continue;
                }
            }
            _ = tick.tick() => {}
        }
        if !batch.is_empty() {
            let spans = std::mem::replace(&mut batch, Vec::with_capacity(batching.batch_size));
            outcome
                .export(&exporter, spans, batching.timeout, &counters)
                .await;
        }
    }
    queued.close();
    loop {
        let left = batching.batch_size - batch.len();
        if left > 0 && queued.recv_many(&mut batch, left).await > 0 {
            continue;
        }
        if batch.is_empty() {
            break;
        }
        let spans = std::mem::take(&mut batch);
        outcome
            .export(&exporter, spans, batching.timeout, &counters)
            .await;
    }
    let _ = exporter.shutdown();
}

/// Whether the last export failed (so a run of failures is logged once).
#[derive(Debug, Default)]
struct Outcome {
    failing: bool,
}

impl Outcome {
    async fn export<E: SpanExporter>(
        &mut self,
        exporter: &E,
        spans: Vec<SpanData>,
        limit: Duration,
        counters: &SpanCounters,
    ) {
        let count = spans.len() as u64;
        let error = match timeout(limit, exporter.export(spans)).await {
            Ok(Ok(())) => {
                counters.exported.inc_by(count);
                if std::mem::take(&mut self.failing) {
                    tracing::info!("exporting spans again");
                }
                return;
            }
            Ok(Err(error)) => error.to_string(),
            Err(_) => format!("no answer within {limit:?}"),
        };
        counters.export_failed.inc_by(count);
        if !std::mem::replace(&mut self.failing, true) {
            tracing::warn!(
                %error,
                spans = count,
                "span export failed: spans are dropped (and counted) until it works again"
            );
        } else {
            tracing::debug!(%error, spans = count, "span export failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::error::OTelSdkError;
    use opentelemetry_sdk::trace::SdkTracerProvider;

    use super::*;

    /// Records exported span names; fails while `failing` is set.
    #[derive(Debug, Clone, Default)]
    struct Recorder {
        names: Arc<Mutex<Vec<String>>>,
        failing: Arc<AtomicBool>,
    }

    impl SpanExporter for Recorder {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            if self.failing.load(Ordering::SeqCst) {
                return Err(OTelSdkError::InternalFailure("down".into()));
            }
            let mut names = self.names.lock().unwrap();
            names.extend(batch.into_iter().map(|span| span.name.into_owned()));
            Ok(())
        }
    }

    fn batching(queue_size: usize) -> Batching {
        Batching {
            queue_size,
            batch_size: 2,
            // Long: only a full batch or the stop exports in these tests.
            interval: Duration::from_secs(3600),
            timeout: Duration::from_secs(5),
        }
    }

    fn counters() -> SpanCounters {
        SpanCounters::register(&Registry::new(), "test").unwrap()
    }

    fn end_spans(provider: &SdkTracerProvider, names: &[&'static str]) {
        let tracer = provider.tracer("test");
        for name in names {
            tracer.start(*name).end();
        }
    }

    #[tokio::test]
    async fn full_queues_drop_and_the_stop_flushes_the_rest() {
        let recorder = Recorder::default();
        let counters = counters();
        // Nothing runs the export task before the stop (one thread, no await in between).
        let (queue, task) = start(recorder.clone(), batching(3), counters.clone());
        let provider = SdkTracerProvider::builder()
            .with_span_processor(queue)
            .build();
        end_spans(&provider, &["a", "b", "c", "d", "e"]);
        assert_eq!(counters.queue_full.get(), 2);
        assert!(task.finish(Duration::from_secs(10)).await);
        assert_eq!(*recorder.names.lock().unwrap(), ["a", "b", "c"]);
        assert_eq!((counters.exported(), counters.dropped()), (3, 2));
    }

    #[tokio::test]
    async fn failed_exports_drop_and_count_their_spans() {
        let recorder = Recorder::default();
        recorder.failing.store(true, Ordering::SeqCst);
        let counters = counters();
        let (queue, task) = start(recorder.clone(), batching(16), counters.clone());
        let provider = SdkTracerProvider::builder()
            .with_span_processor(queue)
            .build();
        end_spans(&provider, &["a", "b", "c"]);
        assert!(task.finish(Duration::from_secs(10)).await);
        assert!(recorder.names.lock().unwrap().is_empty());
        assert_eq!(counters.export_failed.get(), 3);
        assert_eq!(counters.exported(), 0);
    }
}

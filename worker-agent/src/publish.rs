//! The two bus-facing tasks: the publisher (batches in `seq` order onto the model's event
//! subject) and the resync service (snapshot / replay requests on the instance's subject).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvmesh_control::{
    ControlError, EventBus, Message, SnapshotReply, SnapshotRequest, Subscription, reply_parts,
};
use kvmesh_telemetry::Tracer;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanKind;
use tokio::sync::mpsc;

use crate::core::{Core, Outgoing};
use crate::metrics::AgentMetrics;
use crate::trace::AgentSpan;

/// Publishes queued batches until the queue closes; a batch whose translation was traced
/// gets a publish span under it (`tracer`).
pub(crate) async fn publisher(
    bus: Arc<dyn EventBus>,
    subject: String,
    mut queue: mpsc::Receiver<Outgoing>,
    metrics: AgentMetrics,
    tracer: Option<Tracer>,
) {
    while let Some(out) = queue.recv().await {
        let mut span = AgentSpan::start(
            tracer.as_ref().filter(|_| out.trace.is_some()),
            "publish kv events",
            SpanKind::Producer,
            out.trace.as_ref(),
            || {
                vec![
                    KeyValue::new("messaging.system", "nats"),
                    KeyValue::new("messaging.operation.type", "send"),
                    KeyValue::new("messaging.destination.name", subject.clone()),
                    KeyValue::new("messaging.message.body.size", out.payload.len() as i64),
                ]
            },
        );
        let published = if bus.is_durable() {
            publish_until_stored(&*bus, &subject, out.payload).await
        } else {
            bus.publish(&subject, out.payload).await
        };
        match published {
            Ok(()) => metrics
                .publish_seconds
                .observe(out.received.elapsed().as_secs_f64()),
            Err(e) => {
                span.fail(&e);
                metrics.dropped.with_label_values(&["publish_failed"]).inc();
                tracing::debug!(error = %e, "cannot publish a KV event batch");
            }
        }
        span.end();
    }
}

/// First pause before a batch the stream did not take is sent again; doubles per failure.
const STORE_RETRY_FIRST: Duration = Duration::from_millis(100);
/// Longest pause between tries.
const STORE_RETRY_MAX: Duration = Duration::from_secs(2);

/// Publishes through the durable stream, trying again (with backoff) until it is stored:
/// batches are kept in order across a NATS outage, and later ones wait in the queue (which
/// drops, and counts, what does not fit; the proxy resyncs over such a gap).
async fn publish_until_stored(
    bus: &dyn EventBus,
    subject: &str,
    payload: Bytes,
) -> Result<(), ControlError> {
    let mut backoff = STORE_RETRY_FIRST;
    let mut failures = 0u32;
    loop {
        match bus.publish_durable(subject, payload.clone()).await {
            Ok(()) => return Ok(()),
            // A batch too large or a bad subject never gets better.
            Err(error @ (ControlError::PayloadTooLarge { .. } | ControlError::InvalidName(_))) => {
                return Err(error);
            }
            Err(error) => {
                failures += 1;
                if failures.is_power_of_two() {
                    tracing::warn!(%error, failures, "the event stream did not take a batch; trying again");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(STORE_RETRY_MAX);
            }
        }
    }
}

/// Answers resync requests until the subscription ends.
pub(crate) async fn resync_service(
    bus: Arc<dyn EventBus>,
    mut requests: Subscription,
    core: Arc<Core>,
    metrics: AgentMetrics,
) {
    while let Some(request) = requests.next().await {
        let parsed = if request.payload.iter().all(u8::is_ascii_whitespace) {
            Ok(SnapshotRequest::full())
        } else {
            SnapshotRequest::from_json(&request.payload)
        };
        let Ok(parsed) = parsed else {
            metrics
                .resync_requests
                .with_label_values(&["invalid"])
                .inc();
            continue;
        };
        let limit = bus.max_payload();
        let mut reply = core.resync(parsed);
        let mut parts = reply_parts(&reply, limit);
        if matches!(parts, Err(ControlError::PayloadTooLarge { .. }))
            && matches!(reply, SnapshotReply::Events { .. })
        {
            // A replayed batch too large for a part: the whole cache always splits.
            reply = core.resync(SnapshotRequest::full());
            parts = reply_parts(&reply, limit);
        }
        let kind = match &reply {
            SnapshotReply::Events { .. } => "events",
            SnapshotReply::Snapshot { .. } => "snapshot",
        };
        metrics.resync_requests.with_label_values(&[kind]).inc();
        let sent = match parts {
            Ok(parts) => send_parts(&*bus, &request, parts).await,
            Err(e) => Err(e),
        };
        match sent {
            Ok(()) => {}
            Err(ControlError::PayloadTooLarge { size, limit }) => {
                metrics
                    .dropped
                    .with_label_values(&["snapshot_too_large"])
                    .inc();
                tracing::error!(
                    size,
                    limit,
                    "a resync reply does not fit the bus payload limit even in parts"
                );
            }
            Err(e) => tracing::debug!(error = %e, "cannot answer a resync request"),
        }
    }
}

/// Sends the parts of one reply, in order, to the requester.
async fn send_parts(
    bus: &dyn EventBus,
    request: &Message,
    parts: Vec<Bytes>,
) -> Result<(), ControlError> {
    for part in parts {
        bus.reply(request, part).await?;
    }
    Ok(())
}

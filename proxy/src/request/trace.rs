//! The spans of one proxied request (`telemetry` in the config), started and ended at the
//! spine's phase boundaries ([`crate::request`]). Off, a [`RequestTrace`] is empty and every
//! call returns at once: no span, no header read, nothing allocated.
//!
//! On, the request's span (kind server, named `{gen_ai.operation.name} {model}` as the
//! OpenTelemetry GenAI conventions name inference spans) continues the client's
//! `traceparent` when it has a valid one. Its children, in order: `admit`, `prepare`,
//! `queue`, then per engine attempt an `attempt` span (kind client, `server.address` /
//! `server.port`, the engine's status) with a `relay` child while the body streams, and a
//! `migration` span from a stream's break to its continuation's relay. Each attempt sends the
//! engine a `traceparent` naming the attempt span (and the client's `tracestate`). A request
//! its sampler drops keeps only its (unrecorded) span, whose id the engines receive.

use std::time::SystemTime;

use http::HeaderValue;
use kvmesh_telemetry::traceparent::{self, TRACEPARENT, TRACESTATE, TraceParent};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};

use crate::engines::instance::Instance;
use crate::engines::pool::ModelPool;
use crate::openai::headers::TraceHeaders;
use crate::openai::route::Route;
use crate::request::attempt::AttemptError;
use crate::request::frontend::Frontend;
use crate::request::record::Record;
use crate::request::relay::RelayEnd;
use crate::state::shared::State;

/// The OpenTelemetry SDK's span.
type Span = <kvmesh_telemetry::Tracer as opentelemetry::trace::Tracer>::Span;

/// A phase of the request before its first attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The model resolved, the key's limits and the model's slot taken.
    Admit,
    /// The prompt rendered, tokenized and hashed (`policy: kv`), the instances found.
    Prepare,
    /// The wait while every instance is busy (`policy: kv`).
    Queue,
    /// A disaggregated model's prefill leg.
    Prefill,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Self::Admit => "admit",
            Self::Prepare => "prepare",
            Self::Queue => "queue",
            Self::Prefill => "prefill",
        }
    }
}

/// The spans of one request; empty while tracing is off.
pub(crate) struct RequestTrace(Option<Box<Spans>>);

/// A traced request's open spans.
struct Spans {
    tracer: kvmesh_telemetry::Tracer,
    /// The request's span, in the context its children start from.
    root: Context,
    /// The sampler kept the request: its children are recorded too.
    recording: bool,
    /// `gen_ai.operation.name`.
    operation: &'static str,
    /// The phase under way.
    phase: Option<Span>,
    /// The attempt under way (in the context its relay starts from).
    attempt: Option<Context>,
    /// Attempts so far.
    attempts: i64,
    /// The relay under way.
    relay: Option<Span>,
    /// The migration under way: from the break to the continuation's relay.
    migration: Option<Span>,
    /// What the current attempt tells the engine.
    engine: Option<TraceHeaders>,
}

/// `gen_ai.operation.name` of a route's requests.
fn operation(route: Option<Route>) -> &'static str {
    match route {
        Some(Route::Completions) => "text_completion",
        Some(Route::Embeddings) => "embeddings",
        _ => "chat",
    }
}

impl RequestTrace {
    /// Starts the span of `record`'s request (from when its head arrived), continuing the
    /// client's trace when `frontend` sends a valid `traceparent`; empty when tracing is off.
    pub(crate) fn start<F: Frontend>(state: &State, frontend: &F, record: &Record) -> Self {
        let Some(tracer) = state.tracer.as_ref() else {
            return Self(None);
        };
        let parent = frontend
            .header(TRACEPARENT)
            .and_then(|value| traceparent::parse(value, frontend.header(TRACESTATE)));
        let parent = match parent {
            Some(remote) => Context::new().with_remote_span_context(remote),
            None => Context::new(),
        };
        let operation = operation(record.route);
        let started = SystemTime::now()
            .checked_sub(record.started.elapsed())
            .unwrap_or_else(SystemTime::now);
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", operation),
            KeyValue::new(
                "kvmesh.request_id",
                String::from_utf8_lossy(record.request_id.as_bytes()).into_owned(),
            ),
        ];
        if let Some(route) = record.route {
            attributes.push(KeyValue::new("kvmesh.route", route.label()));
        }
        let root = tracer
            .span_builder(operation)
            .with_kind(SpanKind::Server)
            .with_start_time(started)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        let recording = root.is_recording();
        Self(Some(Box::new(Spans {
            tracer: tracer.clone(),
            root: parent.with_span(root),
            recording,
            operation,
            phase: None,
            attempt: None,
            attempts: 0,
            relay: None,
            migration: None,
            engine: None,
        })))
    }

    /// The spans, when the request is recorded.
    fn recorded(&mut self) -> Option<&mut Spans> {
        self.0.as_deref_mut().filter(|spans| spans.recording)
    }

    /// Ends the phase under way and starts `phase`.
    pub(crate) fn phase(&mut self, phase: Phase) {
        if let Some(spans) = self.recorded() {
            spans.end_phase();
            spans.phase = Some(spans.child(phase.name(), SpanKind::Internal, Vec::new()));
        }
    }

    /// The request is for `pool`'s model (`adapter`: one of its LoRA adapters): names the
    /// request's span after it.
    pub(crate) fn model(&mut self, pool: &ModelPool, adapter: Option<&str>) {
        if let Some(spans) = self.recorded() {
            let model = adapter.unwrap_or(pool.name()).to_string();
            let root = spans.root.span();
            root.update_name(format!("{} {model}", spans.operation));
            root.set_attribute(KeyValue::new("gen_ai.request.model", model));
        }
    }

    /// Starts an attempt on `instance` (ending the phase or attempt before it); returns what
    /// the engine request carries for the trace.
    pub(crate) fn attempt(&mut self, instance: &Instance) -> Option<&TraceHeaders> {
        let spans = self.0.as_deref_mut()?;
        if !spans.recording && spans.engine.is_some() {
            // Unrecorded: every attempt names the request's span.
            return spans.engine.as_ref();
        }
        let context = if spans.recording {
            spans.end_phase();
            spans.end_attempt();
            spans.attempts += 1;
            let url = instance.url();
            let attributes = vec![
                KeyValue::new("server.address", url.host().to_string()),
                KeyValue::new("server.port", i64::from(url.port())),
                KeyValue::new("kvmesh.instance", url.as_str().to_string()),
                KeyValue::new("kvmesh.attempt", spans.attempts),
            ];
            let span = spans.child("attempt", SpanKind::Client, attributes);
            let attempt = spans.root.with_span(span);
            let context = attempt.span().span_context().clone();
            spans.attempt = Some(attempt);
            context
        } else {
            spans.root.span().span_context().clone()
        };
        let headers = HeaderValue::from_bytes(TraceParent::of(&context).as_bytes())
            .ok()
            .map(|traceparent| TraceHeaders {
                traceparent,
                tracestate: Some(context.trace_state().header())
                    .filter(|state| !state.is_empty())
                    .and_then(|state| HeaderValue::from_str(&state).ok()),
            });
        spans.engine = headers;
        spans.engine.as_ref()
    }

    /// The attempt failed before a response head.
    pub(crate) fn attempt_failed(&mut self, error: &AttemptError) {
        if let Some(spans) = self.recorded()
            && let Some(attempt) = spans.attempt.take()
        {
            let (kind, detail) = match error {
                AttemptError::Retryable { kind, detail, .. } => (kind.label(), detail.clone()),
                AttemptError::Timeout => ("timeout", "no response head in time".to_string()),
                AttemptError::Unforwardable(detail) => ("unforwardable", detail.clone()),
                AttemptError::ClientGone => ("client_gone", "the client left".to_string()),
                AttemptError::Client(error) => ("client_body", format!("{error:?}")),
            };
            let span = attempt.span();
            span.set_attribute(KeyValue::new("error.type", kind));
            span.set_status(Status::error(detail));
            span.end();
        }
    }

    /// The engine answered the attempt with `status`.
    pub(crate) fn answered(&mut self, status: u16) {
        if let Some(attempt) = self.recorded().and_then(|spans| spans.attempt.as_ref()) {
            let span = attempt.span();
            span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            ));
            if status >= 400 {
                span.set_attribute(KeyValue::new("error.type", status.to_string()));
                span.set_status(Status::error(""));
            }
        }
    }

    /// The engine's answer is dropped and the request tried again elsewhere.
    pub(crate) fn retried(&mut self) {
        if let Some(spans) = self.recorded() {
            spans.end_attempt();
        }
    }

    /// The relay of the attempt's answer starts (ending a migration under way).
    pub(crate) fn relay(&mut self) {
        if let Some(spans) = self.recorded() {
            if let Some(mut migration) = spans.migration.take() {
                migration.end();
            }
            let parent = spans.attempt.as_ref().unwrap_or(&spans.root);
            let span = spans
                .tracer
                .span_builder("relay")
                .with_kind(SpanKind::Internal)
                .start_with_context(&spans.tracer, parent);
            spans.relay = Some(span);
        }
    }

    /// The relay ended as `end`, and with it the attempt.
    pub(crate) fn relayed(&mut self, end: &RelayEnd) {
        if let Some(spans) = self.recorded() {
            let failure = match end {
                RelayEnd::Complete | RelayEnd::ChoiceDone => None,
                RelayEnd::ClientGone => Some("client_gone"),
                RelayEnd::UpstreamFailed { kind, .. } | RelayEnd::Broken(kind) => {
                    Some(kind.label())
                }
            };
            if let Some(mut relay) = spans.relay.take() {
                if let Some(failure) = failure {
                    relay.set_attribute(KeyValue::new("error.type", failure));
                    relay.set_status(Status::error(""));
                }
                relay.end();
            }
            // A client that left is no failure of the engine's.
            if let (Some(failure), Some(attempt)) = (failure, spans.attempt.as_ref())
                && !matches!(end, RelayEnd::ClientGone)
            {
                let span = attempt.span();
                span.set_attribute(KeyValue::new("error.type", failure));
                span.set_status(Status::error("the engine broke off mid-answer"));
            }
            spans.end_attempt();
        }
    }

    /// The stream broke off (`kind`) and continues on another instance.
    pub(crate) fn migrating(&mut self, kind: crate::metrics::failure::FailureKind) {
        if let Some(spans) = self.recorded() {
            let attributes = vec![KeyValue::new("kvmesh.migration.reason", kind.label())];
            spans.migration = Some(spans.child("migration", SpanKind::Internal, attributes));
        }
    }

    /// Ends every span with what `record` says of the request's end.
    pub(crate) fn finish(&mut self, record: &Record) {
        let Some(spans) = self.recorded() else {
            return;
        };
        let failed = record.status >= 400;
        if let Some(mut phase) = spans.phase.take() {
            if failed {
                phase.set_attribute(KeyValue::new("error.type", record.status.to_string()));
                phase.set_status(Status::error(""));
            }
            phase.end();
        }
        if let Some(mut relay) = spans.relay.take() {
            relay.end();
        }
        spans.end_attempt();
        if let Some(mut migration) = spans.migration.take() {
            migration.set_status(Status::error("no instance to continue on"));
            migration.end();
        }
        let root = spans.root.span();
        if record.status != 0 {
            root.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(record.status),
            ));
        }
        if record.status == 200 {
            let input = record.tokens.prompt_tokens().or(record.prompt_tokens);
            if let Some(input) = input.and_then(|tokens| i64::try_from(tokens).ok()) {
                root.set_attribute(KeyValue::new("gen_ai.usage.input_tokens", input));
            }
            let output = i64::try_from(record.tokens.completion_tokens()).unwrap_or(i64::MAX);
            root.set_attribute(KeyValue::new("gen_ai.usage.output_tokens", output));
        }
        if let Some(instance) = record.instance.as_ref().and_then(|i| i.to_str().ok()) {
            root.set_attribute(KeyValue::new("kvmesh.instance", instance.to_string()));
        }
        root.set_attribute(KeyValue::new("kvmesh.stream", record.stream));
        root.set_attribute(KeyValue::new(
            "kvmesh.migrations",
            i64::from(record.migrations),
        ));
        if record.client_gone {
            root.set_attribute(KeyValue::new("kvmesh.client_gone", true));
        }
        if let Some(kind) = record.upstream_failure {
            root.set_attribute(KeyValue::new("error.type", kind.label()));
            root.set_status(Status::error("the engine broke off mid-answer"));
        } else if record.status >= 500 {
            root.set_attribute(KeyValue::new("error.type", record.status.to_string()));
            root.set_status(Status::error(""));
        }
        root.end();
    }
}

impl Spans {
    /// A child of the request's span, starting now.
    fn child(&self, name: &'static str, kind: SpanKind, attributes: Vec<KeyValue>) -> Span {
        self.tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &self.root)
    }

    fn end_phase(&mut self) {
        if let Some(mut phase) = self.phase.take() {
            phase.end();
        }
    }

    fn end_attempt(&mut self) {
        if let Some(attempt) = self.attempt.take() {
            attempt.span().end();
        }
    }
}

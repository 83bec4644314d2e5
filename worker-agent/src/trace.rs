//! The agent's spans (`--otlp-endpoint`): registering the instance, translating an engine
//! batch and publishing the result (a child of its translation). Without a tracer every
//! call returns at once and builds nothing.

use std::fmt::Display;

use kvmesh_telemetry::Tracer;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _,
};
use opentelemetry::{Context, KeyValue};

/// The OpenTelemetry SDK's span.
type Span = <Tracer as opentelemetry::trace::Tracer>::Span;

/// A span of the agent's, or nothing while tracing is off.
pub(crate) struct AgentSpan(Option<Span>);

impl AgentSpan {
    /// Starts `name` (a child of `parent`, when given) with the attributes `attributes`
    /// makes, when `tracer` traces.
    pub(crate) fn start(
        tracer: Option<&Tracer>,
        name: &'static str,
        kind: SpanKind,
        parent: Option<&SpanContext>,
        attributes: impl FnOnce() -> Vec<KeyValue>,
    ) -> Self {
        Self(tracer.map(|tracer| {
            let parent = match parent {
                Some(parent) => Context::new().with_remote_span_context(parent.clone()),
                None => Context::new(),
            };
            tracer
                .span_builder(name)
                .with_kind(kind)
                .with_attributes(attributes())
                .start_with_context(tracer, &parent)
        }))
    }

    /// The span's context (for a child started elsewhere), when recorded.
    pub(crate) fn context(&self) -> Option<SpanContext> {
        self.0
            .as_ref()
            .filter(|span| span.is_recording())
            .map(|span| span.span_context().clone())
    }

    /// Adds the attribute `attribute` makes.
    pub(crate) fn set(&mut self, attribute: impl FnOnce() -> KeyValue) {
        if let Some(span) = self.0.as_mut() {
            span.set_attribute(attribute());
        }
    }

    /// Marks the span failed with `error`.
    pub(crate) fn fail(&mut self, error: &dyn Display) {
        if let Some(span) = self.0.as_mut() {
            span.set_status(Status::error(error.to_string()));
        }
    }

    /// Ends the span.
    pub(crate) fn end(self) {
        if let Some(mut span) = self.0 {
            span.end();
        }
    }
}

//! W3C trace context as the proxy reads it from a client's request (`traceparent` and
//! `tracestate`; `kvmesh_telemetry::traceparent::parse`).
//!
//! Input: the `traceparent` value, then optionally a newline and the `tracestate` value.
//! Whatever they hold: nothing panics; a context that is read is valid and remote, and the
//! `traceparent` written for it reads back to the same trace, span and sampled flag, with the
//! same `tracestate`, which is printable ASCII.

#![no_main]

use kvmesh_telemetry::traceparent::{TraceParent, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (traceparent, tracestate) = match text.split_once('\n') {
        Some((parent, state)) => (parent, Some(state)),
        None => (text, None),
    };
    let Some(context) = parse(traceparent, tracestate) else {
        return;
    };
    assert!(context.is_valid() && context.is_remote());
    let written = TraceParent::of(&context);
    assert_eq!(written.as_bytes().len(), 55);
    let state = context.trace_state().header();
    assert!(
        state.bytes().all(|byte| (b' '..=b'~').contains(&byte)),
        "{state:?}"
    );
    let again = parse(written.as_str(), Some(&state)).expect("what is written is read");
    assert_eq!(
        (again.trace_id(), again.span_id(), again.is_sampled()),
        (context.trace_id(), context.span_id(), context.is_sampled())
    );
    assert_eq!(again.trace_state().header(), state, "tracestate reads back");
});

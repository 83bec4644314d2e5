//! The relay's work per streamed piece, without a network: decoding an engine's chunked
//! SSE body (one chunk per event, as vLLM writes it) and scanning its events. Two reads:
//! one event per read (an engine writing faster than the proxy reads gives more per read)
//! and the whole body in one read. Throughput is in events.
//!
//! Run with `cargo bench -p kvmesh-proxy --bench relay`. Results: `docs/BENCHMARKS.md`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use kvmesh_proxy::bench_support::relay::relay_body;

/// Events of one streamed chat completion (16 tokens, a role event, the finish event).
const EVENTS: usize = 18;

/// One chat-completion chunk event, about the size vLLM sends.
fn event(i: usize) -> String {
    format!(
        "data: {{\"id\":\"chatcmpl-3f9a1c0d2b7e4c5f8a6b9d0e1f2a3b4c\",\"object\":\"chat.completion.chunk\",\"created\":1764000000,\"model\":\"qwen3\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" word{i}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
    )
}

/// The body on the wire: one chunk per event, then `[DONE]` and the last chunk.
fn wire() -> (Vec<u8>, usize) {
    let mut wire = Vec::new();
    let mut largest = 0;
    for text in (0..EVENTS)
        .map(event)
        .chain(std::iter::once("data: [DONE]\n\n".to_string()))
    {
        let chunk = format!("{:x}\r\n{text}\r\n", text.len());
        largest = largest.max(chunk.len());
        wire.extend_from_slice(chunk.as_bytes());
    }
    wire.extend_from_slice(b"0\r\n\r\n");
    (wire, largest)
}

fn relay(criterion: &mut Criterion) {
    let (wire, event_bytes) = wire();
    assert_eq!(relay_body(&wire, event_bytes).0, EVENTS);
    let mut group = criterion.benchmark_group("relay");
    group.throughput(Throughput::Elements(EVENTS as u64));
    for (name, read) in [
        ("one event per read", event_bytes),
        ("one read", wire.len()),
    ] {
        group.bench_with_input(BenchmarkId::new("chunked SSE", name), &read, |b, &read| {
            b.iter(|| relay_body(black_box(&wire), read));
        });
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    relay(&mut criterion);
    criterion.final_summary();
}

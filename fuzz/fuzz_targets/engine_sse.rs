//! An engine's answer body as the proxy reads it while relaying it: server-sent events counted
//! as they pass (`kvmesh_wire::sse::SseScanner`, the HTTP relay), read event by event
//! (`sse_events::SseData`, the gRPC listener), and the tokens the answer holds
//! (`usage::TokenCount`, for metrics, API keys' token limits and the KV index's check), and
//! split into whole events (`sse::split_events`, the migration's rewriting of a continuation).
//!
//! Whatever the bytes: nothing panics; both SSE readers agree with a plain line-by-line
//! reading of the whole stream (the events and their data, the blank lines that end them,
//! what is left unfinished), however the stream is cut into chunks; and the token counts are
//! the same whether the body comes whole or cut: an SSE body one event at a time (the relay
//! passes whole events), any other body anywhere.

#![no_main]

use kvmesh_wire::sse::{SseScanner, data_value, split_events};
use kvmesh_wire::sse_events::SseData;
use kvmesh_wire::usage::TokenCount;
use libfuzzer_sys::fuzz_target;

/// The stream read line by line, the plain way (`\n`, `\r\n` or `\r` end a line).
#[derive(Debug, Default)]
struct Reference {
    /// Each event's data (its data lines' values joined by `\n`).
    events: Vec<Vec<u8>>,
    /// Where each blank line ends, and where its `\r` ends when it ends `\r\n`.
    boundaries: Vec<(usize, Option<usize>)>,
    /// Bytes of the unfinished last line.
    partial_line: usize,
    /// The unfinished event's data so far, if it has a data line.
    open_data: Option<Vec<u8>>,
}

impl Reference {
    fn read(stream: &[u8]) -> Self {
        let mut read = Self::default();
        let mut start = 0;
        let mut at = 0;
        while at < stream.len() {
            if stream[at] != b'\r' && stream[at] != b'\n' {
                at += 1;
                continue;
            }
            let line = &stream[start..at];
            let crlf = stream[at] == b'\r' && stream.get(at + 1) == Some(&b'\n');
            let end = at + 1 + usize::from(crlf);
            if line.is_empty() {
                read.events.extend(read.open_data.take());
                read.boundaries.push((end, crlf.then_some(at + 1)));
            } else if let Some(value) = data_value(line) {
                match &mut read.open_data {
                    Some(data) => {
                        data.push(b'\n');
                        data.extend_from_slice(value);
                    }
                    None => read.open_data = Some(value.to_vec()),
                }
            }
            start = end;
            at = end;
        }
        read.partial_line = stream.len() - start;
        read
    }

    /// Events whose data is not `[DONE]` alone (on each of its lines).
    fn counted(&self) -> usize {
        let done = |data: &Vec<u8>| data.split(|&b| b == b'\n').all(|line| line == b"[DONE]");
        self.events.iter().filter(|data| !done(data)).count()
    }

    /// The last blank line that ends in `start..end` as a scanner fed that chunk reports it:
    /// one whose `\r` came in an earlier chunk counted there; one whose `\n` comes in a later
    /// one ends at its `\r`.
    fn last_boundary(&self, start: usize, end: usize) -> Option<usize> {
        self.boundaries
            .iter()
            .filter_map(|&(at, cr)| match cr {
                Some(cr) if cr <= start => None,
                Some(cr) if at > end => Some(cr),
                _ => Some(at),
            })
            .filter(|&at| at > start && at <= end)
            .max()
    }
}

/// A cut point in `0..=len` that follows the bytes.
fn cut(data: &[u8], salt: u64) -> usize {
    let hash = data
        .iter()
        .fold(salt ^ 0xcbf2_9ce4_8422_2325, |hash, &byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
    (hash % (data.len() as u64 + 1)) as usize
}

/// Feeds `stream` cut at `cuts` (ascending) to both SSE readers and checks them against the
/// reference.
fn read_in_chunks(stream: &[u8], cuts: &[usize], reference: &Reference) {
    let mut scanner = SseScanner::default();
    let mut data = SseData::default();
    let mut counted = 0;
    let mut events = Vec::new();
    let mut start = 0;
    for &end in cuts.iter().chain(std::iter::once(&stream.len())) {
        let chunk = &stream[start..end];
        let scan = scanner.feed(chunk);
        counted += scan.data_events;
        assert_eq!(
            scan.last_boundary.map(|at| start + at),
            reference.last_boundary(start, end),
            "chunk {start}..{end}"
        );
        data.feed(chunk, |event| events.push(event.to_vec()));
        start = end;
    }
    assert_eq!(counted, reference.counted(), "cut at {cuts:?}");
    assert_eq!(events, reference.events, "cut at {cuts:?}");
    let open = reference.open_data.as_ref();
    assert_eq!(
        data.pending_len(),
        reference.partial_line + open.map_or(0, Vec::len)
    );
    assert_eq!(
        scanner.mid_event(),
        reference.partial_line > 0 || open.is_some()
    );
}

/// What a token count holds.
fn counts(count: &TokenCount) -> (u64, Option<u64>, Option<u64>) {
    (
        count.completion_tokens(),
        count.prompt_tokens(),
        count.cached_tokens(),
    )
}

fn observed(pieces: &[&[u8]], event_stream: bool) -> (u64, Option<u64>, Option<u64>) {
    let mut count = TokenCount::default();
    pieces
        .iter()
        .for_each(|piece| count.observe(piece, event_stream));
    counts(&count)
}

fuzz_target!(|stream: &[u8]| {
    let reference = Reference::read(stream);
    read_in_chunks(stream, &[], &reference);
    read_in_chunks(stream, &[cut(stream, 1)], &reference);
    let (x, y) = (cut(stream, 2), cut(stream, 3));
    read_in_chunks(stream, &[x.min(y), x.max(y)], &reference);

    // An SSE body: whole events, all at once or one at a time.
    let mut events = Vec::new();
    let mut start = 0;
    for &(end, _) in &reference.boundaries {
        events.push(&stream[start..end]);
        start = end;
    }
    let whole_events = &stream[..start];
    // The migration splits whole events as the reference does, the unended rest last.
    let mut split: Vec<&[u8]> = split_events(stream).collect();
    if start < stream.len() {
        assert_eq!(split.pop(), Some(&stream[start..]), "the unended rest");
    }
    assert_eq!(split, events, "split_events");
    assert_eq!(
        observed(&[whole_events], true),
        observed(&events, true),
        "SSE, event by event"
    );

    // Any other body, cut anywhere.
    let whole = observed(&[stream], false);
    let one = cut(stream, 4);
    assert_eq!(
        whole,
        observed(&[&stream[..one], &stream[one..]], false),
        "cut at {one}"
    );
});

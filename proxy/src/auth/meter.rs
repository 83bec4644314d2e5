//! Charging completion tokens while the response streams.
//!
//! SSE responses: every `data:` event but `[DONE]` is one token as it passes;
//! when an event carries `usage.completion_tokens` (vLLM with
//! `stream_options.include_usage`), the charge is corrected to that count.
//! Other responses are charged the `completion_tokens` of their `usage`.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use crate::auth::ApiKey;

/// The field whose number is the authoritative completion count.
const USAGE_FIELD: &[u8] = b"\"completion_tokens\"";
/// The data line that ends an OpenAI stream.
const DONE_EVENT: &[u8] = b"data: [DONE]";
/// The start of an SSE data line.
const DATA_PREFIX: &[u8] = b"data:";
/// Bytes of a non-SSE body kept between chunks, so a field split across two is found.
const TAIL_BYTES: usize = 64;

/// Charges one response's completion tokens to its key.
#[derive(Debug)]
pub(crate) struct CompletionMeter {
    key: Arc<ApiKey>,
    state: Mutex<MeterState>,
}

#[derive(Debug)]
struct MeterState {
    /// Tokens charged so far for this response.
    charged: i64,
    /// Bytes of `data:` matched at the start of the current line (SSE).
    line_prefix: Option<usize>,
    /// The end of the body seen so far (non-SSE).
    tail: Vec<u8>,
}

impl CompletionMeter {
    /// A meter charging `key`.
    pub(crate) fn new(key: Arc<ApiKey>) -> Self {
        Self {
            key,
            state: Mutex::new(MeterState {
                charged: 0,
                line_prefix: Some(0),
                tail: Vec::new(),
            }),
        }
    }

    /// Charges what `chunk`, a piece of the body the client now receives, holds.
    pub(crate) fn observe(&self, chunk: &[u8], event_stream: bool) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let delta = if event_stream {
            state.observe_events(chunk)
        } else {
            state.observe_body(chunk)
        };
        if delta != 0 {
            self.key.charge(delta, true, Instant::now());
        }
    }
}

impl MeterState {
    /// SSE: one token per data event, then the reported usage wins.
    fn observe_events(&mut self, chunk: &[u8]) -> i64 {
        let mut events = 0i64;
        for &byte in chunk {
            self.line_prefix = match self.line_prefix {
                _ if byte == b'\n' => Some(0),
                Some(matched) if DATA_PREFIX.get(matched) == Some(&byte) => {
                    if matched + 1 == DATA_PREFIX.len() {
                        events += 1;
                        None
                    } else {
                        Some(matched + 1)
                    }
                }
                _ => None,
            };
        }
        events -= occurrences(chunk, DONE_EVENT);
        let counted = self.charged + events.max(0);
        let target = last_usage(chunk).unwrap_or(counted);
        let delta = target - self.charged;
        self.charged = target;
        delta
    }

    /// Non-SSE: the reported usage, once it has passed.
    fn observe_body(&mut self, chunk: &[u8]) -> i64 {
        self.tail.extend_from_slice(chunk);
        let found = last_usage(&self.tail);
        let keep_from = self.tail.len().saturating_sub(TAIL_BYTES);
        self.tail.drain(..keep_from);
        match found {
            Some(reported) if reported > self.charged => {
                let delta = reported - self.charged;
                self.charged = reported;
                delta
            }
            _ => 0,
        }
    }
}

/// How often `needle` occurs in `haystack`.
fn occurrences(haystack: &[u8], needle: &[u8]) -> i64 {
    let count = haystack
        .windows(needle.len())
        .filter(|window| *window == needle)
        .count();
    i64::try_from(count).unwrap_or(i64::MAX)
}

/// The number after the last `"completion_tokens":` in `text`.
fn last_usage(text: &[u8]) -> Option<i64> {
    let start = text
        .windows(USAGE_FIELD.len())
        .rposition(|window| window == USAGE_FIELD)?
        + USAGE_FIELD.len();
    let rest = &text[start..];
    let rest = rest
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> MeterState {
        MeterState {
            charged: 0,
            line_prefix: Some(0),
            tail: Vec::new(),
        }
    }

    #[test]
    fn sse_events_count_as_they_pass_and_usage_corrects() {
        let mut meter = state();
        assert_eq!(
            meter.observe_events(b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\n"),
            2
        );
        assert_eq!(meter.observe_events(b"da"), 0);
        assert_eq!(meter.observe_events(b"ta: {\"c\":3}\n\n"), 1);
        assert_eq!(meter.observe_events(b": comment data: x\n\n"), 0);
        let usage = b"data: {\"usage\":{\"prompt_tokens\":9,\"completion_tokens\": 7}}\n\n";
        assert_eq!(meter.observe_events(usage), 4);
        assert_eq!(meter.observe_events(b"data: [DONE]\n\n"), 0);
        assert_eq!(meter.charged, 7);
        let mut over = state();
        over.observe_events(b"data: 1\n\ndata: 2\n\ndata: 3\n\n");
        assert_eq!(
            over.observe_events(b"data: {\"completion_tokens\":1}\n\n"),
            -2
        );
    }

    #[test]
    fn bodies_are_charged_their_usage_even_when_split() {
        let mut meter = state();
        assert_eq!(
            meter.observe_body(b"{\"choices\":[],\"usage\":{\"completion_tok"),
            0
        );
        assert_eq!(meter.observe_body(b"ens\":1"), 1);
        assert_eq!(meter.observe_body(b"23,\"prompt_tokens\":4}}"), 122);
        assert_eq!(meter.charged, 123);
        assert!(meter.tail.len() <= TAIL_BYTES);
        assert_eq!(last_usage(b"\"completion_tokens\":x"), None);
    }
}

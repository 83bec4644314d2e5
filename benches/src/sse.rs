//! Incremental scanning of a server-sent-event stream for `data:` lines, across arbitrary chunk
//! boundaries.

use crate::scan;

/// What one `data:` line of an OpenAI stream says, as far as the load generator cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DataEvent {
    /// The line carries generated text (a content event).
    pub content: bool,
    /// The line is the `[DONE]` terminator.
    pub done: bool,
    /// The line is an error object sent in place of a chunk.
    pub error: bool,
    /// `usage.completion_tokens`, when the chunk reports usage.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens`, when the chunk reports usage.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`, when the chunk reports it.
    pub cached_tokens: Option<u64>,
}

impl DataEvent {
    /// Classifies the payload of one `data:` line (without the `data:` prefix).
    pub fn classify(payload: &[u8]) -> Self {
        if payload == b"[DONE]" {
            return Self {
                done: true,
                ..Self::default()
            };
        }
        if scan::is_error_object(payload) {
            return Self {
                error: true,
                ..Self::default()
            };
        }
        let completion_tokens = scan::completion_tokens(payload);
        // Only a chunk that reports usage is searched for the prompt's counts.
        let (prompt_tokens, cached_tokens) = if completion_tokens.is_some() {
            (scan::prompt_tokens(payload), scan::cached_tokens(payload))
        } else {
            (None, None)
        };
        Self {
            content: scan::has_content(payload),
            completion_tokens,
            prompt_tokens,
            cached_tokens,
            ..Self::default()
        }
    }
}

/// Splits a byte stream into lines and reports every `data:` line; keeps only the unfinished
/// last line between chunks, so complete lines are scanned in place without copying.
#[derive(Debug, Default)]
pub struct SseScanner {
    partial: Vec<u8>,
}

impl SseScanner {
    /// A scanner with an empty line buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets any unfinished line (call before reusing the scanner for another stream).
    pub fn reset(&mut self) {
        self.partial.clear();
    }

    /// Scans the next chunk of the stream, calling `on_event` for each complete `data:` line.
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(DataEvent)) {
        let mut rest = chunk;
        if !self.partial.is_empty() {
            let Some(end) = rest.iter().position(|b| *b == b'\n') else {
                self.partial.extend_from_slice(rest);
                return;
            };
            self.partial.extend_from_slice(&rest[..end]);
            scan_line(&self.partial, &mut on_event);
            self.partial.clear();
            rest = &rest[end + 1..];
        }
        while let Some(end) = rest.iter().position(|b| *b == b'\n') {
            scan_line(&rest[..end], &mut on_event);
            rest = &rest[end + 1..];
        }
        self.partial.extend_from_slice(rest);
    }

    /// Ends the stream: a last line without a newline still counts.
    pub fn finish(&mut self, mut on_event: impl FnMut(DataEvent)) {
        if !self.partial.is_empty() {
            scan_line(&self.partial, &mut on_event);
            self.partial.clear();
        }
    }
}

fn scan_line(line: &[u8], on_event: &mut impl FnMut(DataEvent)) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if let Some(payload) = line.strip_prefix(b"data:") {
        let payload = payload.strip_prefix(b" ").unwrap_or(payload);
        on_event(DataEvent::classify(payload));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    const STREAM: &[u8] = b": keep-alive comment\n\
data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\r\n\r\n\
event: message\n\
data:{\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n\
data: {\"choices\":[{\"text\":\" there\"}]}\n\n\
data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":70,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n\
data: [DONE]\n\n";

    fn expected() -> Vec<DataEvent> {
        let content = DataEvent {
            content: true,
            ..DataEvent::default()
        };
        vec![
            DataEvent::default(),
            content,
            content,
            content,
            DataEvent {
                completion_tokens: Some(3),
                prompt_tokens: Some(70),
                cached_tokens: Some(64),
                ..DataEvent::default()
            },
            DataEvent {
                done: true,
                ..DataEvent::default()
            },
        ]
    }

    fn scan_in_pieces(pieces: &[&[u8]]) -> Vec<DataEvent> {
        let mut scanner = SseScanner::new();
        let mut events = Vec::new();
        for piece in pieces {
            scanner.feed(piece, |e| events.push(e));
        }
        scanner.finish(|e| events.push(e));
        events
    }

    #[test]
    fn whole_stream_in_one_chunk() {
        assert_eq!(scan_in_pieces(&[STREAM]), expected());
    }

    #[test]
    fn every_single_split_point() {
        for cut in 0..=STREAM.len() {
            let (a, b) = STREAM.split_at(cut);
            assert_eq!(scan_in_pieces(&[a, b]), expected(), "cut at {cut}");
        }
    }

    #[test]
    fn every_pair_of_split_points() {
        for i in 0..=STREAM.len() {
            for j in i..=STREAM.len() {
                let pieces = [&STREAM[..i], &STREAM[i..j], &STREAM[j..]];
                assert_eq!(scan_in_pieces(&pieces), expected(), "cuts {i},{j}");
            }
        }
    }

    #[test]
    fn one_byte_at_a_time() {
        let pieces: Vec<&[u8]> = STREAM.chunks(1).collect();
        assert_eq!(scan_in_pieces(&pieces), expected());
    }

    #[test]
    fn random_chunk_sizes() {
        let mut rng = SplitMix64::new(99);
        for _ in 0..500 {
            let mut pieces = Vec::new();
            let mut rest = STREAM;
            while !rest.is_empty() {
                let n = 1 + rng.next_index(rest.len().min(40));
                let (head, tail) = rest.split_at(n);
                pieces.push(head);
                rest = tail;
            }
            assert_eq!(scan_in_pieces(&pieces), expected());
        }
    }

    #[test]
    fn last_line_without_newline_is_reported_at_finish() {
        let events = scan_in_pieces(&[b"data: [DO", b"NE]"]);
        assert_eq!(
            events,
            vec![DataEvent {
                done: true,
                ..DataEvent::default()
            }]
        );
    }

    #[test]
    fn reset_drops_an_unfinished_line() {
        let mut scanner = SseScanner::new();
        let mut events = Vec::new();
        scanner.feed(b"data: {\"choices\":[{\"text\":\"x", |e| events.push(e));
        scanner.reset();
        scanner.feed(b"data: [DONE]\n", |e| events.push(e));
        assert_eq!(events.len(), 1);
        assert!(events[0].done);
    }

    #[test]
    fn error_objects_are_flagged() {
        let events = scan_in_pieces(&[b"data: {\"error\":{\"message\":\"overloaded\"}}\n\n"]);
        assert!(events[0].error);
        assert!(!events[0].content);
    }
}

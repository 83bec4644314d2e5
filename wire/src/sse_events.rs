//! The data of server-sent events, event by event, from a body that arrives in chunks
//! cut anywhere. (The proxy's HTTP relay only counts events, see [`crate::sse`]; its gRPC
//! listener needs their data.)

use crate::sse::data_value;

/// The data of an event that ended the stream: `[DONE]`.
pub const DONE: &[u8] = b"[DONE]";

/// Line and event state carried between chunks.
#[derive(Debug, Default)]
pub struct SseData {
    /// The current line so far.
    line: Vec<u8>,
    /// The current event's data lines, joined by `\n`.
    data: Vec<u8>,
    /// The current event has a data field.
    has_data: bool,
    /// The previous byte ended a line with `\r` (a following `\n` belongs to it).
    after_cr: bool,
}

impl SseData {
    /// Feeds the next chunk; `on_event` gets the data of every event it completes.
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(&[u8])) {
        let mut rest = chunk;
        while let Some(at) = memchr::memchr2(b'\n', b'\r', rest) {
            let (line, tail) = rest.split_at(at);
            let ending = tail[0];
            rest = &tail[1..];
            if ending == b'\n' && self.after_cr && line.is_empty() && self.line.is_empty() {
                // The `\n` of a `\r\n` whose `\r` already ended the line.
                self.after_cr = false;
                continue;
            }
            self.after_cr = ending == b'\r';
            self.line.extend_from_slice(line);
            self.end_line(&mut on_event);
        }
        if !rest.is_empty() {
            self.after_cr = false;
            self.line.extend_from_slice(rest);
        }
    }

    /// Bytes held for an unfinished line or event.
    pub fn pending_len(&self) -> usize {
        self.line.len() + self.data.len()
    }

    fn end_line(&mut self, on_event: &mut impl FnMut(&[u8])) {
        if self.line.is_empty() {
            if self.has_data {
                on_event(&self.data);
            }
            self.data.clear();
            self.has_data = false;
            return;
        }
        if let Some(value) = data_value(&self.line) {
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        self.line.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &[u8] = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":2}\r\n\r\nevent: x\ndata: one\ndata: two\n\ndata: [DONE]\n\n";

    fn events(stream: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut parser = SseData::default();
        let mut out = Vec::new();
        let mut start = 0;
        for &end in cuts.iter().chain(std::iter::once(&stream.len())) {
            parser.feed(&stream[start..end], |data| out.push(data.to_vec()));
            start = end;
        }
        out
    }

    #[test]
    fn yields_each_event_data_wherever_the_chunks_are_cut() {
        let expected: Vec<Vec<u8>> = vec![
            b"{\"a\":1}".to_vec(),
            b"{\"b\":2}".to_vec(),
            b"one\ntwo".to_vec(),
            DONE.to_vec(),
        ];
        assert_eq!(events(STREAM, &[]), expected);
        for cut in 0..=STREAM.len() {
            assert_eq!(events(STREAM, &[cut]), expected, "cut at {cut}");
        }
        let every: Vec<usize> = (1..STREAM.len()).collect();
        assert_eq!(events(STREAM, &every), expected);
    }

    #[test]
    fn bare_carriage_returns_end_lines() {
        assert_eq!(
            events(b"data: a\r\rdata: b\r\r", &[]),
            vec![b"a".to_vec(), b"b".to_vec()]
        );
    }

    #[test]
    fn unfinished_events_are_held() {
        let mut parser = SseData::default();
        let mut seen = 0;
        parser.feed(b"data: {\"partial", |_| seen += 1);
        assert_eq!(seen, 0);
        assert!(parser.pending_len() > 0);
        parser.feed(b"\"}\n\n", |_| seen += 1);
        assert_eq!(seen, 1);
        assert_eq!(parser.pending_len(), 0);
    }
}

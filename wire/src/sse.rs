//! Incremental scanning of a server-sent-event stream as it passes through.
//!
//! The scanner never copies the stream: it walks each chunk once, keeping only
//! the few bytes of the current line's start that it needs to recognise a
//! `data:` field and the `[DONE]` sentinel. Chunk boundaries may fall anywhere,
//! including inside a line ending.

/// The most bytes of a line the scanner looks at: `data: [DONE]`.
const PREFIX_CAPACITY: usize = 12;

/// What one chunk contained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChunkScan {
    /// Events completed in this chunk that carry data other than `[DONE]`.
    pub data_events: usize,
    /// Offset just past the last event boundary (blank line) in this chunk, if any.
    pub last_boundary: Option<usize>,
}

/// Line-level state carried from one chunk to the next.
#[derive(Debug, Default)]
pub struct SseScanner {
    /// First bytes of the current line.
    prefix: [u8; PREFIX_CAPACITY],
    /// How many of `prefix` are filled.
    prefix_len: usize,
    /// Whether the current line is longer than `prefix`.
    long_line: bool,
    /// Whether the current line has any byte (before its line ending).
    line_started: bool,
    /// The previous byte was a `\r` (a following `\n` belongs to the same line ending).
    after_cr: bool,
    /// The current event has a `data` field.
    event_has_data: bool,
    /// Every `data` field of the current event is `[DONE]`.
    event_is_done: bool,
}

impl SseScanner {
    /// Scans the next chunk of the stream. Line contents are skipped to the next line
    /// ending at once (`memchr`); only line endings and the first bytes of a line are
    /// looked at one by one.
    pub fn feed(&mut self, chunk: &[u8]) -> ChunkScan {
        let mut scan = ChunkScan::default();
        let mut at = 0;
        while at < chunk.len() {
            let ending =
                memchr::memchr2(b'\r', b'\n', &chunk[at..]).map_or(chunk.len(), |i| at + i);
            if ending > at {
                self.line_bytes(&chunk[at..ending]);
            }
            let Some(&byte) = chunk.get(ending) else {
                break;
            };
            if byte == b'\n' && self.after_cr {
                self.after_cr = false;
                // The line already ended at the `\r`; a boundary found there now
                // extends over this `\n`.
                if scan.last_boundary == Some(ending) {
                    scan.last_boundary = Some(ending + 1);
                }
            } else {
                self.after_cr = byte == b'\r';
                if self.end_line() {
                    scan.last_boundary = Some(ending + 1);
                    if self.dispatch() {
                        scan.data_events += 1;
                    }
                }
            }
            at = ending + 1;
        }
        scan
    }

    /// Takes `bytes` (no line ending among them) as more of the current line.
    fn line_bytes(&mut self, bytes: &[u8]) {
        self.after_cr = false;
        self.line_started = true;
        let room = PREFIX_CAPACITY - self.prefix_len;
        let kept = room.min(bytes.len());
        self.prefix[self.prefix_len..self.prefix_len + kept].copy_from_slice(&bytes[..kept]);
        self.prefix_len += kept;
        self.long_line |= bytes.len() > room;
    }

    /// Whether the stream currently sits inside an unfinished event or line.
    pub fn mid_event(&self) -> bool {
        self.line_started || self.event_has_data
    }

    /// Ends the current line; returns `true` when it was blank (an event boundary).
    fn end_line(&mut self) -> bool {
        if !self.line_started {
            return true;
        }
        let line = &self.prefix[..self.prefix_len];
        if let Some(value) = data_value(line) {
            let is_done = !self.long_line && value == b"[DONE]";
            self.event_is_done = is_done && (self.event_is_done || !self.event_has_data);
            self.event_has_data = true;
        }
        self.prefix_len = 0;
        self.long_line = false;
        self.line_started = false;
        false
    }

    /// Ends the current event; returns `true` when it carried data other than `[DONE]`.
    fn dispatch(&mut self) -> bool {
        let counted = self.event_has_data && !self.event_is_done;
        self.event_has_data = false;
        self.event_is_done = false;
        counted
    }
}

/// The `data` values of the lines of `bytes` (whole lines; `\n`, `\r\n` or `\r` endings, as
/// [`SseScanner`] reads them), found with `memchr` rather than byte by byte.
pub fn data_values(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        while !rest.is_empty() {
            // The blank line between the `\r` and the `\n` of a `\r\n` holds no data.
            let (line, tail) = match memchr::memchr2(b'\r', b'\n', rest) {
                Some(end) => (&rest[..end], &rest[end + 1..]),
                None => (rest, &rest[rest.len()..]),
            };
            rest = tail;
            if let Some(value) = data_value(line) {
                return Some(value);
            }
        }
        None
    })
}

/// The events of `bytes`, each with the blank line that ends it (lines end with `\n`, `\r\n`
/// or `\r`, as [`SseScanner`] reads them); bytes after the last blank line come last, as an
/// unended event. A `\r\n` is one line ending, so a blank line ends after its `\n`.
pub fn split_events(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut line_start = 0;
        let end = loop {
            let Some(offset) = memchr::memchr2(b'\r', b'\n', &rest[line_start..]) else {
                break rest.len();
            };
            let ending = line_start + offset;
            let crlf = rest[ending] == b'\r' && rest.get(ending + 1) == Some(&b'\n');
            let after = ending + 1 + usize::from(crlf);
            if ending == line_start {
                break after;
            }
            line_start = after;
        };
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

/// The value of a `data` field line (`data`, `data:` or `data: x`), if it is one.
pub fn data_value(line: &[u8]) -> Option<&[u8]> {
    let rest = line.strip_prefix(b"data")?;
    if rest.is_empty() {
        return Some(rest);
    }
    let value = rest.strip_prefix(b":")?;
    Some(value.strip_prefix(b" ").unwrap_or(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &[u8] = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":2}\r\n\r\nevent: x\ndata: one\ndata: two\n\ndata: [DONE]\n\n";

    /// Feeds `stream` cut at `cuts`; returns (events, absolute boundaries).
    fn scan_split(stream: &[u8], cuts: &[usize]) -> (usize, Vec<usize>) {
        let mut scanner = SseScanner::default();
        let mut events = 0;
        let mut boundaries = Vec::new();
        let mut start = 0;
        for &end in cuts.iter().chain(std::iter::once(&stream.len())) {
            let scan = scanner.feed(&stream[start..end]);
            events += scan.data_events;
            if let Some(b) = scan.last_boundary {
                boundaries.push(start + b);
            }
            start = end;
        }
        (events, boundaries)
    }

    #[test]
    fn counts_data_events_but_not_comments_or_done() {
        let (events, boundaries) = scan_split(STREAM, &[]);
        assert_eq!(events, 3);
        assert_eq!(boundaries, vec![STREAM.len()]);
    }

    #[test]
    fn every_split_point_gives_the_same_count() {
        for cut in 0..=STREAM.len() {
            let (events, _) = scan_split(STREAM, &[cut]);
            assert_eq!(events, 3, "cut at {cut}");
        }
        for a in 0..=STREAM.len() {
            for b in a..=STREAM.len() {
                let (events, _) = scan_split(STREAM, &[a, b]);
                assert_eq!(events, 3, "cuts at {a}, {b}");
            }
        }
    }

    #[test]
    fn byte_by_byte_boundaries_match_blank_lines() {
        let cuts: Vec<usize> = (1..STREAM.len()).collect();
        let (events, boundaries) = scan_split(STREAM, &cuts);
        assert_eq!(events, 3);
        let first = b"data: {\"a\":1}\n\n".len();
        assert_eq!(boundaries[0], first);
        assert_eq!(*boundaries.last().unwrap(), STREAM.len());
        for b in &boundaries {
            let before = &STREAM[..*b];
            // A CRLF split between chunks ends the event at its CR.
            assert!(
                before.ends_with(b"\n\n") || before.ends_with(b"\r\n\r"),
                "boundary at {b}"
            );
        }
    }

    #[test]
    fn crlf_split_between_cr_and_lf_extends_the_boundary_only_within_a_chunk() {
        let stream = b"data: x\r\n\r\n";
        let mut scanner = SseScanner::default();
        let scan = scanner.feed(&stream[..10]);
        assert_eq!(scan.data_events, 1);
        assert_eq!(scan.last_boundary, Some(10));
        let scan = scanner.feed(&stream[10..]);
        assert_eq!(scan, ChunkScan::default());
        assert!(!scanner.mid_event());
    }

    #[test]
    fn bare_cr_line_endings_work() {
        let (events, boundaries) = scan_split(b"data: a\r\rdata: b\r\r", &[]);
        assert_eq!(events, 2);
        assert_eq!(boundaries, vec![18]);
    }

    #[test]
    fn tracks_unfinished_events() {
        let mut scanner = SseScanner::default();
        scanner.feed(b"data: {\"partial");
        assert!(scanner.mid_event());
        scanner.feed(b"\"}\n");
        assert!(scanner.mid_event());
        let scan = scanner.feed(b"\n");
        assert_eq!(scan.data_events, 1);
        assert!(!scanner.mid_event());
    }

    #[test]
    fn data_values_are_the_data_lines_of_whole_lines() {
        let values: Vec<&[u8]> = data_values(STREAM).collect();
        assert_eq!(
            values,
            [&b"{\"a\":1}"[..], b"{\"b\":2}", b"one", b"two", b"[DONE]"]
        );
        assert_eq!(data_values(b"data:x").collect::<Vec<_>>(), [&b"x"[..]]);
        assert_eq!(data_values(b"").count(), 0);
    }

    /// Found by the fuzz target `engine_sse`: a stream whose lines end in a bare `\r` was read
    /// as one line holding one value, while the scanner counted its events.
    #[test]
    fn data_values_end_lines_at_a_bare_cr_too() {
        let stream = b"data: a\r\rdata: b\r\rdata: c\r\n\r\n";
        assert_eq!(
            data_values(stream).collect::<Vec<_>>(),
            [&b"a"[..], b"b", b"c"]
        );
        assert_eq!(scan_split(stream, &[]).0, 3);
    }

    #[test]
    fn done_only_counts_when_it_is_the_whole_value() {
        let (events, _) = scan_split(b"data: [DONE] and more\n\ndata:[DONE]\n\ndata\n\n", &[]);
        assert_eq!(events, 2);
        let (events, _) = scan_split(b"data: [DONE]\ndata: x\n\n", &[]);
        assert_eq!(events, 1);
        let (events, _) = scan_split(b"dat: x\n\ndatax: y\n\n", &[]);
        assert_eq!(events, 0);
    }

    #[test]
    fn long_lines_are_still_data() {
        let long = format!("data: {}\n\n", "x".repeat(10_000));
        let (events, boundaries) = scan_split(long.as_bytes(), &[3, 5000]);
        assert_eq!(events, 1);
        assert_eq!(boundaries, vec![long.len()]);
    }

    /// The whole stream read line by line, the plain way: the number of data events and,
    /// for each blank line, where it ends (and where its `\r` ends, when it ends `\r\n`).
    fn reference(stream: &[u8]) -> (usize, Vec<(usize, Option<usize>)>) {
        let (mut events, mut boundaries) = (0, Vec::new());
        let (mut has_data, mut all_done) = (false, true);
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
                if has_data && !all_done {
                    events += 1;
                }
                (has_data, all_done) = (false, true);
                boundaries.push((end, crlf.then_some(at + 1)));
            } else if let Some(value) = data_value(line) {
                has_data = true;
                all_done &= value == b"[DONE]";
            }
            start = end;
            at = end;
        }
        (events, boundaries)
    }

    /// Pieces SSE streams are made of.
    const PIECES: &[&str] = &[
        "data: ",
        "data:",
        "data",
        "[DONE]",
        "{\"x\":1}",
        ": keep-alive",
        "event: y",
        "\r",
        "\n",
        "\r\n",
        "d",
        "abcdefghijklmnop",
    ];

    #[test]
    fn events_split_at_blank_lines_of_every_line_ending() {
        let stream = b"data: a\n\ndata: b\r\n\r\ndata: c\r\rdata: d\r\n\ndata: e";
        let events: Vec<&[u8]> = split_events(stream).collect();
        assert_eq!(
            events,
            [
                &b"data: a\n\n"[..],
                b"data: b\r\n\r\n",
                b"data: c\r\r",
                b"data: d\r\n\n",
                b"data: e"
            ]
        );
        // A blank line first is an event of its own, with nothing in it.
        assert_eq!(split_events(b"\ndata: x\n\n").count(), 2);
        assert_eq!(split_events(b"").count(), 0);
    }

    proptest::proptest! {
        #[test]
        fn events_end_where_the_whole_stream_has_its_blank_lines(
            pieces in proptest::collection::vec(proptest::sample::select(PIECES), 0..40),
        ) {
            let stream = pieces.concat().into_bytes();
            let (_, boundaries) = reference(&stream);
            let events: Vec<&[u8]> = split_events(&stream).collect();
            proptest::prop_assert_eq!(events.concat(), stream.clone());
            let mut ends = Vec::new();
            let mut at = 0;
            for event in &events {
                at += event.len();
                ends.push(at);
            }
            let blank: Vec<usize> = boundaries.iter().map(|&(end, _)| end).collect();
            if ends.last() != blank.last() {
                // Bytes after the last blank line: one unended event.
                ends.pop();
            }
            proptest::prop_assert_eq!(ends, blank);
        }

        #[test]
        fn chunks_scan_as_the_whole_stream_reads(
            pieces in proptest::collection::vec(proptest::sample::select(PIECES), 0..40),
            cuts in proptest::collection::vec(0usize..400, 0..8),
        ) {
            let stream = pieces.concat().into_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|cut| cut % (stream.len() + 1)).collect();
            cuts.sort_unstable();
            let (events, boundaries) = reference(&stream);
            let mut scanner = SseScanner::default();
            let mut seen = 0;
            let mut start = 0;
            for end in cuts.into_iter().chain(std::iter::once(stream.len())) {
                let scan = scanner.feed(&stream[start..end]);
                seen += scan.data_events;
                // The last blank line ending in this chunk; one whose `\r` came in an
                // earlier chunk already counted there.
                let expected = boundaries
                    .iter()
                    .filter_map(|&(at, cr)| match cr {
                        Some(cr) if cr <= start => None,
                        Some(cr) if at > end => Some(cr),
                        _ => Some(at),
                    })
                    .filter(|&at| at > start && at <= end)
                    .max();
                proptest::prop_assert_eq!(scan.last_boundary.map(|b| start + b), expected);
                start = end;
            }
            proptest::prop_assert_eq!(seen, events);
        }
    }
}

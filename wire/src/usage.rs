//! Counting a response's tokens as its body passes: the completion tokens (SSE: one per data
//! event that carries text, corrected by a reported `usage.completion_tokens`; other bodies:
//! their `usage.completion_tokens`), the prompt tokens the engine reports
//! (`usage.prompt_tokens`) and the part it had cached
//! (`usage.prompt_tokens_details.cached_tokens`). Feeds the token metrics, the API keys'
//! token meter and the KV index's check against the engine.
//!
//! SSE bodies arrive as whole events (the relay holds an event back until it is complete),
//! so each piece is read line by line, and usage only in the values of data lines (what is
//! in comments, or cut across lines, is not usage). Events without text are not tokens:
//! `[DONE]`, a chat stream's opening role event and closing empty delta, a usage-only event.

use std::sync::LazyLock;

use memchr::memmem::Finder;

/// The end the usage fields share: `"completion_tokens"` (the authoritative completion
/// count), `"prompt_tokens"` (the prompt's) and `"cached_tokens"` (its cached part). One
/// forward search finds each.
static TOKENS_FIELD_END: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"_tokens\""));
/// The searches for what the data of an event without text holds (built once: a search
/// built per call cost more than the search).
static TEXTLESS_FINDERS: LazyLock<Vec<Finder<'static>>> =
    LazyLock::new(|| TEXTLESS.iter().map(Finder::new).collect());
/// The empty string, object and array, one of which every textless event holds.
static EMPTY_FINDERS: LazyLock<[Finder<'static>; 3]> =
    LazyLock::new(|| [Finder::new(b"\"\""), Finder::new(b"{}"), Finder::new(b"[]")]);
/// What the data of an event without text holds (compact and spaced JSON).
const TEXTLESS: [&[u8]; 8] = [
    b"\"content\":\"\"",
    b"\"content\": \"\"",
    b"\"text\":\"\"",
    b"\"text\": \"\"",
    b"\"delta\":{}",
    b"\"delta\": {}",
    b"\"choices\":[]",
    b"\"choices\": []",
];
/// Bytes of a non-SSE body kept between chunks, so a field split across two is found.
const TAIL_BYTES: usize = 64;
/// The most bytes of a non-SSE body kept from a usage field whose number has not ended yet
/// (beyond: the field is not read), so a number cut off by a chunk's end is read whole.
const MAX_PENDING_BYTES: usize = 4096;

/// One response's token counts so far.
#[derive(Debug, Default)]
pub struct TokenCount {
    /// SSE data events with text seen.
    events: u64,
    /// The end of the non-SSE body so far.
    tail: Vec<u8>,
    /// The last reported `completion_tokens`.
    completion: Option<u64>,
    /// The last reported `prompt_tokens`.
    prompt: Option<u64>,
    /// The last reported `cached_tokens`.
    cached: Option<u64>,
}

impl TokenCount {
    /// Takes in `chunk`, the next piece of the body the client receives (`event_stream`: an
    /// SSE body).
    pub fn observe(&mut self, chunk: &[u8], event_stream: bool) {
        if event_stream {
            for data in crate::sse::data_values(chunk) {
                self.events += u64::from(has_text(data));
                self.take_usage(data);
            }
        } else {
            self.tail.extend_from_slice(chunk);
            let tail = std::mem::take(&mut self.tail);
            let pending = self.take_usage(&tail);
            self.tail = tail;
            let mut keep_from = self.tail.len().saturating_sub(TAIL_BYTES);
            if let Some(start) = pending
                && self.tail.len() - start <= MAX_PENDING_BYTES
            {
                keep_from = keep_from.min(start);
            }
            self.tail.drain(..keep_from);
        }
    }

    /// Takes in `chunk`, the next piece of an SSE body, whose data events carrying text were
    /// already counted (`text_events`, by the migration transcript): only its usage is read.
    pub fn observe_counted(&mut self, chunk: &[u8], text_events: u64) {
        self.events += text_events;
        for data in crate::sse::data_values(chunk) {
            self.take_usage(data);
        }
    }

    /// Takes the last `"completion_tokens": N`, `"prompt_tokens": N` and
    /// `"cached_tokens": N` of `text`. Returns where the last field starts if its number
    /// may not have ended (`text` ends in it).
    fn take_usage(&mut self, text: &[u8]) -> Option<usize> {
        let end = TOKENS_FIELD_END.needle().len();
        let mut pending = None;
        for at in TOKENS_FIELD_END.find_iter(text) {
            let field = &text[..at];
            let (name, slot) = if field.ends_with(b"\"completion") {
                ("\"completion", &mut self.completion)
            } else if field.ends_with(b"\"prompt") {
                ("\"prompt", &mut self.prompt)
            } else if field.ends_with(b"\"cached") {
                ("\"cached", &mut self.cached)
            } else {
                continue;
            };
            match number_after(&text[at + end..]) {
                Number::Value(value) => *slot = Some(value),
                Number::Garbled => {}
                Number::Unfinished => pending = Some(at - name.len()),
            }
        }
        pending
    }

    /// Completion tokens so far: the reported count, else (SSE) the data events.
    pub fn completion_tokens(&self) -> u64 {
        self.completion.unwrap_or(self.events)
    }

    /// The prompt tokens the engine reported, if it did.
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.prompt
    }

    /// The prompt tokens the engine reported it had cached, if it did.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.cached
    }
}

/// Whether an event's data carries generated text (a token). Every textless marker holds an
/// empty string, object or array, so one pass looking for those decides most events.
fn has_text(data: &[u8]) -> bool {
    let data = data.trim_ascii();
    if data.is_empty() || data == b"[DONE]" {
        return false;
    }
    let has_empty = EMPTY_FINDERS.iter().any(|empty| empty.find(data).is_some());
    !has_empty
        || !TEXTLESS_FINDERS
            .iter()
            .any(|marker| marker.find(data).is_some())
}

/// What follows a usage field's name.
#[derive(Debug, PartialEq, Eq)]
enum Number {
    /// `: N`.
    Value(u64),
    /// Something else, or a number that does not fit.
    Garbled,
    /// Blanks, the colon and digits up to the end of the text: the number may go on.
    Unfinished,
}

/// The number after a field name: `rest` starts just past the name's closing quote.
fn number_after(rest: &[u8]) -> Number {
    let rest = rest.trim_ascii_start();
    let Some(rest) = rest.strip_prefix(b":") else {
        return if rest.is_empty() {
            Number::Unfinished
        } else {
            Number::Garbled
        };
    };
    let rest = rest.trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == rest.len() {
        return Number::Unfinished;
    }
    std::str::from_utf8(&rest[..digits])
        .ok()
        .and_then(|digits| digits.parse().ok())
        .map_or(Number::Garbled, Number::Value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_count_as_they_pass_and_usage_corrects() {
        let mut count = TokenCount::default();
        count.observe(b"data: {\"a\":1}\n\ndata: {\"b\":2}\r\n\r\n", true);
        assert_eq!(count.completion_tokens(), 2);
        count.observe(b"data: {\"c\":3}\n\n: comment data: x\n\n", true);
        assert_eq!(count.completion_tokens(), 3);
        let role = br#"data: {"choices":[{"delta":{"role":"assistant","content":""}}]}"#;
        let last = br#"data: {"choices":[{"delta":{},"finish_reason":"stop"}]}"#;
        let spaced = br#"data: {"choices": [{"text": "", "finish_reason": "length"}]}"#;
        for textless in [&role[..], last, spaced, b"data: [DONE]", b"data:"] {
            count.observe(&[textless, b"\n\n"].concat(), true);
        }
        assert_eq!(
            count.completion_tokens(),
            3,
            "events without text are no tokens"
        );
        assert_eq!(count.prompt_tokens(), None);
        let usage = b"data: {\"usage\":{\"prompt_tokens\":9,\"completion_tokens\": 7}}\n\n";
        count.observe(usage, true);
        count.observe(b"data: [DONE]\n\n", true);
        assert_eq!(
            (count.completion_tokens(), count.prompt_tokens()),
            (7, Some(9))
        );
        assert_eq!(count.cached_tokens(), None);
    }

    /// Found by the fuzz target `engine_sse`: events ending in bare `\r`s, passed together,
    /// counted as one token; one at a time, as two.
    #[test]
    fn events_count_the_same_whatever_ends_their_lines() {
        let mut together = TokenCount::default();
        together.observe(b"data: a\r\rdata: b\r\r", true);
        let mut apart = TokenCount::default();
        apart.observe(b"data: a\r\r", true);
        apart.observe(b"data: b\r\r", true);
        assert_eq!(together.completion_tokens(), 2);
        assert_eq!(apart.completion_tokens(), 2);
    }

    /// Found by the fuzz target `engine_sse`: a number too large for 64 bits, cut by a chunk's
    /// end, was read as its first digits. The fix (a field whose number runs to the chunk's end
    /// waits for the next) also reads a number that a chunk's end cut from its field name by
    /// more than 64 bytes of blanks, which was not read at all.
    #[test]
    fn a_number_cut_by_a_chunk_is_read_whole() {
        let overflow = format!("Y\"completion_tokens\":{}i", "3".repeat(30));
        let mut count = TokenCount::default();
        count.observe(&overflow.as_bytes()[..30], false);
        count.observe(&overflow.as_bytes()[30..], false);
        assert_eq!(count.completion, None);
        let spaced = format!("{{\"prompt_tokens\":{}12,\"x\":1}}", " ".repeat(100));
        for cut in [10, 30, 100, 117, 118] {
            let mut count = TokenCount::default();
            count.observe(&spaced.as_bytes()[..cut], false);
            assert_eq!(count.prompt_tokens(), None, "cut at {cut}");
            count.observe(&spaced.as_bytes()[cut..], false);
            assert_eq!(count.prompt_tokens(), Some(12), "cut at {cut}");
            assert!(count.tail.len() <= TAIL_BYTES);
        }
        assert_eq!(number_after(b": 12"), Number::Unfinished);
        assert_eq!(number_after(b" "), Number::Unfinished);
        assert_eq!(number_after(b": 12}"), Number::Value(12));
        assert_eq!(number_after(b"x: 1}"), Number::Garbled);
    }

    /// Found by the fuzz target `engine_sse`: a usage field whose number followed in the next
    /// event was read when both events came in one piece, and not when they came one by one.
    /// Usage is read in data values only, never across lines nor in comments.
    #[test]
    fn sse_usage_is_read_within_a_data_line() {
        for pieces in [
            &[&b"data: {\"cached_tokens\"\r\r:0\r\r"[..]][..],
            &[b"data: {\"cached_tokens\"\r\r", b":0\r\r"],
        ] {
            let mut count = TokenCount::default();
            pieces.iter().for_each(|piece| count.observe(piece, true));
            assert_eq!(count.cached_tokens(), None, "{pieces:?}");
        }
        let mut comment = TokenCount::default();
        comment.observe(b": {\"completion_tokens\": 9}\n\ndata: x\n\n", true);
        assert_eq!(comment.completion_tokens(), 1);
        let mut counted = TokenCount::default();
        counted.observe_counted(
            b": \"prompt_tokens\": 3\n\ndata: {\"prompt_tokens\": 4}\n\n",
            1,
        );
        assert_eq!(
            (counted.completion_tokens(), counted.prompt_tokens()),
            (1, Some(4))
        );
    }

    #[test]
    fn the_cached_part_of_the_prompt_is_read_as_vllm_reports_it() {
        // vLLM 0.32's usage with --enable-prompt-tokens-details.
        let body = br#"{"usage":{"prompt_tokens":70,"total_tokens":71,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        let mut count = TokenCount::default();
        count.observe(&body[..40], false);
        count.observe(&body[40..], false);
        assert_eq!(count.prompt_tokens(), Some(70));
        assert_eq!(count.cached_tokens(), Some(64));
        let mut streamed = TokenCount::default();
        let event = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":70,\"prompt_tokens_details\": {\"cached_tokens\": 32}}}\n\n";
        streamed.observe(event, true);
        assert_eq!(streamed.cached_tokens(), Some(32));
    }

    #[test]
    fn bodies_count_their_usage_even_when_split() {
        let mut count = TokenCount::default();
        count.observe(b"{\"choices\":[],\"usage\":{\"completion_tok", false);
        assert_eq!(count.completion_tokens(), 0);
        count.observe(b"ens\":1", false);
        count.observe(b"23,\"prompt_tokens\":4}}", false);
        assert_eq!(
            (count.completion_tokens(), count.prompt_tokens()),
            (123, Some(4))
        );
        assert!(count.tail.len() <= TAIL_BYTES);
        let mut garbled = TokenCount::default();
        garbled.observe(b"{\"completion_tokens\":x,\"total_tokens\":5}", false);
        assert_eq!((garbled.completion, garbled.prompt), (None, None));
        // The last of several reports counts.
        let mut twice = TokenCount::default();
        twice.observe(b"data: {\"usage\":{\"completion_tokens\":3}}\n\ndata: {\"usage\":{\"completion_tokens\":4}}\n\n", true);
        assert_eq!(twice.completion_tokens(), 4);
    }
}

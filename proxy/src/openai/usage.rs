//! Counting a response's tokens as its body passes: the completion tokens (SSE: one per data
//! event that carries text, corrected by a reported `usage.completion_tokens`; other bodies:
//! their `usage.completion_tokens`), the prompt tokens the engine reports
//! (`usage.prompt_tokens`) and the part it had cached
//! (`usage.prompt_tokens_details.cached_tokens`). Feeds the token metrics, the API keys'
//! token meter and the KV index's check against the engine.
//!
//! SSE bodies arrive as whole events (the relay holds an event back until it is complete),
//! so each piece is read line by line. Events without text are not tokens: `[DONE]`, a chat
//! stream's opening role event and closing empty delta, a usage-only event.

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

/// One response's token counts so far.
#[derive(Debug, Default)]
pub(crate) struct TokenCount {
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
    pub(crate) fn observe(&mut self, chunk: &[u8], event_stream: bool) {
        if event_stream {
            self.observe_events(chunk);
            self.take_usage(chunk);
        } else {
            self.tail.extend_from_slice(chunk);
            let tail = std::mem::take(&mut self.tail);
            self.take_usage(&tail);
            self.tail = tail;
            let keep_from = self.tail.len().saturating_sub(TAIL_BYTES);
            self.tail.drain(..keep_from);
        }
    }

    /// Takes in `chunk`, the next piece of an SSE body, whose data events carrying text were
    /// already counted (`text_events`, by the migration transcript): only its usage is read.
    pub(crate) fn observe_counted(&mut self, chunk: &[u8], text_events: u64) {
        self.events += text_events;
        self.take_usage(chunk);
    }

    fn observe_events(&mut self, chunk: &[u8]) {
        let tokens = crate::openai::sse::data_values(chunk)
            .filter(|data| has_text(data))
            .count();
        self.events += tokens as u64;
    }

    /// Takes the last `"completion_tokens": N`, `"prompt_tokens": N` and
    /// `"cached_tokens": N` of `text`.
    fn take_usage(&mut self, text: &[u8]) {
        let end = TOKENS_FIELD_END.needle().len();
        for at in TOKENS_FIELD_END.find_iter(text) {
            let field = &text[..at];
            let number = || number_after(&text[at + end..]);
            if field.ends_with(b"\"completion") {
                self.completion = number().or(self.completion);
            } else if field.ends_with(b"\"prompt") {
                self.prompt = number().or(self.prompt);
            } else if field.ends_with(b"\"cached") {
                self.cached = number().or(self.cached);
            }
        }
    }

    /// Completion tokens so far: the reported count, else (SSE) the data events.
    pub(crate) fn completion_tokens(&self) -> u64 {
        self.completion.unwrap_or(self.events)
    }

    /// The prompt tokens the engine reported, if it did.
    pub(crate) fn prompt_tokens(&self) -> Option<u64> {
        self.prompt
    }

    /// The prompt tokens the engine reported it had cached, if it did.
    pub(crate) fn cached_tokens(&self) -> Option<u64> {
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

/// The number after a field name: `rest` starts just past the name's closing quote.
fn number_after(rest: &[u8]) -> Option<u64> {
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

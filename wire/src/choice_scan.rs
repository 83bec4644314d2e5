//! Reading a streamed chunk's one choice without parsing the chunk: its index, generated piece
//! and whether it finished, for the common shape of an engine's stream chunk (one choice, so
//! one `"index"`, the piece as a string without escapes, a `finish_reason`). Anything else is
//! left to a JSON parser ([`Scanned::Unsure`]).
//!
//! The scan reads field names, not the document's structure: when it is sure, the data (if it
//! is JSON) has exactly one key `index`, at most one key `text` (or `content`) and at most one
//! `finish_reason`, wherever they are, with the values it reports. In an OpenAI chunk they
//! are the choice's (`content` its `delta`'s), so the scan reads what a parser reads; data
//! that holds them elsewhere (and not in its choice) would be misread. Data with a backslash
//! anywhere is left to the parser, as an escape could hide a key (`"ind\u0065x"`) or make one
//! (`"a\"index": 1`).
//!
//! A migration's transcript (kvmesh-proxy) reads every event of every stream that may migrate;
//! parsing each with serde was most of a stream's cost in the proxy (BENCHMARKS.md,
//! *Instructions per request*). Property-tested against serde below, and fuzzed
//! (`fuzz/fuzz_targets/openai_fields.rs`).

use std::sync::LazyLock;

use memchr::memmem::Finder;

static INDEX: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"index\""));
static TEXT: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"text\""));
static CONTENT: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"content\""));
static FINISH: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"finish_reason\""));

/// What the scan read of an event's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scanned<'a> {
    /// The event's one choice, surely: its index, its piece (`None`: none, or an empty one)
    /// and whether it finished.
    Choice {
        /// Its `index`.
        index: usize,
        /// The generated text it carries.
        piece: Option<&'a str>,
        /// It has a non-null `finish_reason`.
        finished: bool,
    },
    /// Not the simple shape: parse it.
    Unsure,
}

/// Scans `data` (one event's JSON) for its one choice's piece: `"text"` (completions) or
/// `"content"` (chat, `chat: true`).
pub fn only_choice(data: &[u8], chat: bool) -> Scanned<'_> {
    if memchr::memchr(b'\\', data).is_some() {
        return Scanned::Unsure;
    }
    let mut indexes = INDEX.find_iter(data);
    let (Some(at), None) = (indexes.next(), indexes.next()) else {
        return Scanned::Unsure;
    };
    let Some(index) = value_after(data, at + INDEX.needle().len()).and_then(small_number) else {
        return Scanned::Unsure;
    };
    let field = if chat { &*CONTENT } else { &*TEXT };
    let mut fields = field.find_iter(data);
    let piece = match (fields.next(), fields.next()) {
        (None, _) => None,
        (Some(at), None) => match value_after(data, at + field.needle().len()) {
            Some(value) if value.starts_with(b"null") => None,
            Some(value) if value.first() == Some(&b'"') => match plain_string(&value[1..]) {
                Some(text) => Some(text).filter(|text| !text.is_empty()),
                None => return Scanned::Unsure,
            },
            _ => return Scanned::Unsure,
        },
        (Some(_), Some(_)) => return Scanned::Unsure,
    };
    let mut finishes = FINISH.find_iter(data);
    let finished = match (finishes.next(), finishes.next()) {
        (None, _) => false,
        (Some(at), None) => match value_after(data, at + FINISH.needle().len()) {
            Some(value) if value.starts_with(b"null") => false,
            Some(value) if value.first() == Some(&b'"') => true,
            _ => return Scanned::Unsure,
        },
        (Some(_), Some(_)) => return Scanned::Unsure,
    };
    Scanned::Choice {
        index,
        piece,
        finished,
    }
}

/// What follows a field name ending at `end`: past blanks, a colon and blanks (`None`: no
/// colon, so the name was a value).
fn value_after(data: &[u8], end: usize) -> Option<&[u8]> {
    let rest = data.get(end..)?.trim_ascii_start().strip_prefix(b":")?;
    Some(rest.trim_ascii_start())
}

/// The JSON number `value` starts with, when it is a small whole number written plainly
/// (no leading zero, sign, fraction or exponent).
fn small_number(value: &[u8]) -> Option<usize> {
    let digits = value.iter().take_while(|b| b.is_ascii_digit()).count();
    let plain = matches!(digits, 1..=4)
        && (digits == 1 || value[0] != b'0')
        && !matches!(value.get(digits), Some(b'.' | b'e' | b'E'));
    plain.then(|| {
        (value[..digits].iter()).fold(0, |number, digit| number * 10 + usize::from(digit - b'0'))
    })
}

/// A JSON string's text from just past its opening quote (the data has no backslash, so the
/// string has no escape); `None` when it does not end or is not UTF-8.
fn plain_string(rest: &[u8]) -> Option<&str> {
    let end = memchr::memchr(b'"', rest)?;
    std::str::from_utf8(&rest[..end]).ok()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;

    /// What serde reads of the one choice, as the scan should.
    fn by_serde(data: &[u8], chat: bool) -> (u64, Option<String>, bool) {
        let value: Value = serde_json::from_slice(data).unwrap();
        let [choice] = value["choices"].as_array().unwrap().as_slice() else {
            panic!("one choice: {value}");
        };
        let text = if chat {
            &choice["delta"]["content"]
        } else {
            &choice["text"]
        };
        let piece = text.as_str().filter(|t| !t.is_empty()).map(str::to_owned);
        let index = choice["index"].as_u64().unwrap();
        (index, piece, !choice["finish_reason"].is_null())
    }

    #[test]
    fn vllms_chunks_are_read_without_parsing() {
        let chat = br#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]}"#;
        assert_eq!(
            only_choice(chat, true),
            Scanned::Choice {
                index: 0,
                piece: Some(" world"),
                finished: false
            }
        );
        let last = br#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null}]}"#;
        assert_eq!(
            only_choice(last, false),
            Scanned::Choice {
                index: 0,
                piece: None,
                finished: true
            }
        );
        let usage = br#"{"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":3}}"#;
        assert_eq!(only_choice(usage, false), Scanned::Unsure);
        let escaped = br#"{"choices":[{"index":0,"text":"a \"quote\"","finish_reason":null}]}"#;
        assert_eq!(only_choice(escaped, false), Scanned::Unsure);
        let second = br#"{"choices":[{"index":12,"text":"x","finish_reason":null}]}"#;
        assert_eq!(
            only_choice(second, false),
            Scanned::Choice {
                index: 12,
                piece: Some("x"),
                finished: false
            }
        );
        for odd in ["01", "1.0", "1e1", "-1", "12345"] {
            let data =
                format!(r#"{{"choices":[{{"index":{odd},"text":"x","finish_reason":null}}]}}"#);
            assert_eq!(
                only_choice(data.as_bytes(), false),
                Scanned::Unsure,
                "{odd}"
            );
        }
        let two = br#"{"choices":[{"index":0,"text":"x"},{"index":1,"text":"y"}]}"#;
        assert_eq!(only_choice(two, false), Scanned::Unsure);
    }

    #[test]
    fn escapes_are_left_to_serde() {
        // Found writing the `openai_fields` fuzz target: a key ending in an escaped quote
        // and `index` was read as the choice's index, which serde reads as 0 (absent).
        let made = br#"{"choices":[{"text":"x","finish_reason":null}],"a\"index":7}"#;
        assert_eq!(only_choice(made, false), Scanned::Unsure);
        // A key written with an escape is still that key to serde: two `index` keys.
        let hidden = br#"{"choices":[{"ind\u0065x":3,"text":"x"}],"usage":{"index":0}}"#;
        assert_eq!(only_choice(hidden, false), Scanned::Unsure);
        let elsewhere = br#"{"model":"a\/b","choices":[{"index":0,"text":"x"}]}"#;
        assert_eq!(only_choice(elsewhere, false), Scanned::Unsure);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Whenever the scan is sure, it reads what serde reads.
        #[test]
        fn a_sure_scan_agrees_with_serde(
            text in prop::option::of("\\PC{0,12}|[a-z \"\\\\]{0,8}|text|content|\"index\": 1"),
            finish in prop::option::of("stop|length"),
            index in prop::sample::select(vec![0u64, 0, 0, 1, 10, 123]),
            chat in any::<bool>(),
            pretty in any::<bool>(),
            extra in prop::option::of("\\PC{0,8}"),
        ) {
            let choice = if chat {
                json!({"index": index, "delta": {"content": text, "role": extra}, "logprobs": null, "finish_reason": finish})
            } else {
                json!({"index": index, "text": text, "logprobs": extra, "finish_reason": finish})
            };
            let chunk = json!({"id": "x", "object": "o", "created": 1, "model": extra, "choices": [choice]});
            let data = if pretty {
                serde_json::to_vec_pretty(&chunk).unwrap()
            } else {
                serde_json::to_vec(&chunk).unwrap()
            };
            if let Scanned::Choice { index, piece, finished } = only_choice(&data, chat) {
                let scanned = (index as u64, piece.map(str::to_owned), finished);
                prop_assert_eq!(scanned, by_serde(&data, chat));
            }
        }
    }
}

//! Reading a stream event's first choice without parsing the event: the generated piece of
//! choice 0 and whether it finished, for the common shape of a one-choice stream (one
//! `"index": 0`, the piece as a string without escapes, a `finish_reason`). Anything else is
//! left to serde ([`Scanned::Unsure`]), so the scan never decides what it is not sure of.
//! A migration's transcript reads every event of every stream that may migrate; parsing each
//! with serde was most of a stream's cost in the proxy (BENCHMARKS.md, *Instructions per
//! request*). Property-tested against serde below.

use std::sync::LazyLock;

use memchr::memmem::Finder;

static INDEX: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"index\""));
static TEXT: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"text\""));
static CONTENT: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"content\""));
static FINISH: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"finish_reason\""));

/// What the scan read of an event's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Scanned<'a> {
    /// Choice 0, surely: its piece (`None`: none, or an empty one) and whether it finished.
    Choice {
        /// The generated text it carries.
        piece: Option<&'a str>,
        /// It has a non-null `finish_reason`.
        finished: bool,
    },
    /// Not the simple shape: parse it.
    Unsure,
}

/// Scans `data` (one event's JSON) for choice 0's piece: `"text"` (completions) or
/// `"content"` (chat, `chat: true`).
pub(super) fn first_choice(data: &[u8], chat: bool) -> Scanned<'_> {
    let mut indexes = INDEX.find_iter(data);
    let (Some(at), None) = (indexes.next(), indexes.next()) else {
        return Scanned::Unsure;
    };
    let index = value_after(data, at + INDEX.needle().len()).unwrap_or_default();
    if !index.starts_with(b"0") || index.get(1).is_some_and(u8::is_ascii_digit) {
        return Scanned::Unsure;
    }
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
    Scanned::Choice { piece, finished }
}

/// What follows a field name ending at `end`: past blanks, a colon and blanks (`None`: no
/// colon, so the name was a value).
fn value_after(data: &[u8], end: usize) -> Option<&[u8]> {
    let rest = data.get(end..)?.trim_ascii_start().strip_prefix(b":")?;
    Some(rest.trim_ascii_start())
}

/// A JSON string's text from just past its opening quote, when it has no escape (`None`:
/// it has one, or does not end).
fn plain_string(rest: &[u8]) -> Option<&str> {
    let end = memchr::memchr2(b'"', b'\\', rest)?;
    if rest[end] != b'"' {
        return None;
    }
    std::str::from_utf8(&rest[..end]).ok()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;

    /// What serde reads of choice 0, as the scan should.
    fn by_serde(data: &[u8], chat: bool) -> (Option<String>, bool) {
        let value: Value = serde_json::from_slice(data).unwrap();
        let mut piece = None;
        let mut finished = false;
        for choice in value["choices"].as_array().into_iter().flatten() {
            if choice["index"].as_u64().unwrap_or(0) != 0 {
                continue;
            }
            let text = if chat {
                &choice["delta"]["content"]
            } else {
                &choice["text"]
            };
            piece = text.as_str().filter(|t| !t.is_empty()).map(str::to_owned);
            finished |= !choice["finish_reason"].is_null();
        }
        (piece, finished)
    }

    #[test]
    fn vllms_chunks_are_read_without_parsing() {
        let chat = br#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]}"#;
        assert_eq!(
            first_choice(chat, true),
            Scanned::Choice {
                piece: Some(" world"),
                finished: false
            }
        );
        let last = br#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null}]}"#;
        assert_eq!(
            first_choice(last, false),
            Scanned::Choice {
                piece: None,
                finished: true
            }
        );
        let usage = br#"{"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":3}}"#;
        assert_eq!(first_choice(usage, false), Scanned::Unsure);
        let escaped = br#"{"choices":[{"index":0,"text":"a \"quote\"","finish_reason":null}]}"#;
        assert_eq!(first_choice(escaped, false), Scanned::Unsure);
        let second = br#"{"choices":[{"index":1,"text":"x","finish_reason":null}]}"#;
        assert_eq!(first_choice(second, false), Scanned::Unsure);
        let tenth = br#"{"choices":[{"index":01,"text":"x","finish_reason":null}]}"#;
        assert_eq!(first_choice(tenth, false), Scanned::Unsure);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Whenever the scan is sure, it reads what serde reads.
        #[test]
        fn a_sure_scan_agrees_with_serde(
            text in prop::option::of("\\PC{0,12}|[a-z \"\\\\]{0,8}|text|content|\"index\": 1"),
            finish in prop::option::of("stop|length"),
            index in prop::sample::select(vec![0u64, 0, 0, 1, 10]),
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
            if let Scanned::Choice { piece, finished } = first_choice(&data, chat) {
                prop_assert_eq!((piece.map(str::to_owned), finished), by_serde(&data, chat));
            }
        }
    }
}

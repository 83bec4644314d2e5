//! Reading the engine's OpenAI completion answers: a whole completion, a streamed chunk,
//! or an error body.

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// Longest engine error text quoted in a gRPC status message.
pub const MAX_ERROR_CHARS: usize = 512;

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
}

/// What one engine message (a completion, or a chunk of a streamed one) carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Piece {
    /// Generated text.
    pub text: String,
    /// Why generation stopped, once it has.
    pub finish_reason: Option<String>,
    /// Token counts, once known.
    pub usage: Option<Usage>,
}

impl Piece {
    /// Folds a later piece of the same answer into this one.
    pub fn absorb(&mut self, later: Piece) {
        self.text.push_str(&later.text);
        if later.finish_reason.is_some() {
            self.finish_reason = later.finish_reason;
        }
        if later.usage.is_some() {
            self.usage = later.usage;
        }
    }

    /// A chunk that only reports token counts.
    pub fn is_usage_only(&self) -> bool {
        self.text.is_empty() && self.finish_reason.is_none() && self.usage.is_some()
    }
}

/// A `T` read from a JSON object only: serde's derived structs also read an array, by
/// position, which no engine writes.
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Fields<T> {
            type Value = T;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map))
            }
        }
        deserializer
            .deserialize_map(Fields(PhantomData))
            .map(Object)
    }
}

#[derive(Deserialize)]
struct Completion {
    #[serde(default)]
    choices: Vec<Object<Choice>>,
    #[serde(default)]
    usage: Option<Object<UsageJson>>,
    #[serde(default)]
    error: Option<ErrorJson>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ErrorJson {
    Object(Object<ErrorObject>),
    Text(String),
}

#[derive(Deserialize)]
struct ErrorObject {
    #[serde(default)]
    message: Option<String>,
}

#[derive(Deserialize)]
struct FlatError {
    message: String,
}

/// A completion or a streamed chunk (its first choice); `Err` holds the engine's message
/// when it is an error object, or why it could not be read.
pub fn parse_completion(json: &[u8]) -> Result<Piece, String> {
    let Object(completion) = serde_json::from_slice::<Object<Completion>>(json)
        .map_err(|error| format!("the engine's answer is not a completion: {error}"))?;
    if let Some(error) = completion.error {
        return Err(format!(
            "the engine reported an error: {}",
            error_text(error)
        ));
    }
    let choice = completion.choices.into_iter().next();
    let (text, finish_reason) = choice.map_or((None, None), |Object(c)| (c.text, c.finish_reason));
    Ok(Piece {
        text: text.unwrap_or_default(),
        finish_reason,
        usage: completion.usage.map(|Object(u)| Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
        }),
    })
}

/// The message of an engine error body: OpenAI's `{"error": {"message"}}`, a flat
/// `{"message"}`, or the text itself (shortened).
pub fn error_message(body: &[u8]) -> String {
    if let Ok(Object(Completion {
        error: Some(error), ..
    })) = serde_json::from_slice::<Object<Completion>>(body)
    {
        return error_text(error);
    }
    if let Ok(Object(flat)) = serde_json::from_slice::<Object<FlatError>>(body) {
        return shorten(&flat.message);
    }
    shorten(String::from_utf8_lossy(body).trim())
}

fn error_text(error: ErrorJson) -> String {
    match error {
        ErrorJson::Object(Object(ErrorObject { message })) => {
            shorten(message.as_deref().unwrap_or("(no message)"))
        }
        ErrorJson::Text(text) => shorten(&text),
    }
}

fn shorten(text: &str) -> String {
    match text.char_indices().nth(MAX_ERROR_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_completions_and_chunks() {
        let whole = br#"{"id":"x","object":"text_completion","choices":[{"index":0,"text":"abc","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}"#;
        let piece = parse_completion(whole).unwrap();
        assert_eq!(piece.text, "abc");
        assert_eq!(piece.finish_reason.as_deref(), Some("length"));
        assert_eq!(
            piece.usage,
            Some(Usage {
                prompt_tokens: 4,
                completion_tokens: 3
            })
        );
        let chunk = br#"{"choices":[{"index":0,"text":" d","finish_reason":null}]}"#;
        assert_eq!(
            parse_completion(chunk).unwrap(),
            Piece {
                text: " d".into(),
                ..Default::default()
            }
        );
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}"#;
        assert!(parse_completion(usage).unwrap().is_usage_only());
    }

    /// Found by the fuzz target `engine_json`: `[[], []]` read as a completion with a usage
    /// of 0 and 0 tokens (serde reads a struct from an array, field by field).
    #[test]
    fn arrays_are_not_completions() {
        for array in [
            &br#"[[], []]"#[..],
            br#"{"choices":[["abc", "length"]]}"#,
            br#"{"choices":[],"usage":[4, 3]}"#,
            br#"{"error":["boom"]}"#,
        ] {
            let error = parse_completion(array).unwrap_err();
            assert!(error.contains("not a completion"), "{error}");
        }
        assert_eq!(
            error_message(br#"["Model not found"]"#),
            r#"["Model not found"]"#
        );
    }

    #[test]
    fn errors_carry_the_engine_message() {
        let error = parse_completion(br#"{"error":{"message":"boom","type":"x"}}"#).unwrap_err();
        assert_eq!(error, "the engine reported an error: boom");
        assert!(
            parse_completion(b"not json")
                .unwrap_err()
                .contains("not a completion")
        );
        assert_eq!(
            error_message(br#"{"error":{"message":"max_tokens too large"}}"#),
            "max_tokens too large"
        );
        assert_eq!(
            error_message(br#"{"message":"Model not found","type":"Not Found","code":404}"#),
            "Model not found"
        );
        assert_eq!(error_message(b" plain text \n"), "plain text");
        let long = "x".repeat(MAX_ERROR_CHARS + 10);
        assert_eq!(
            error_message(long.as_bytes()).chars().count(),
            MAX_ERROR_CHARS + 1
        );
    }

    #[test]
    fn pieces_fold_in_order() {
        let mut folded = Piece::default();
        folded.absorb(Piece {
            text: "a".into(),
            ..Default::default()
        });
        folded.absorb(Piece {
            text: "b".into(),
            finish_reason: Some("stop".into()),
            usage: None,
        });
        let usage = Piece {
            usage: Some(Usage {
                prompt_tokens: 1,
                completion_tokens: 2,
            }),
            ..Default::default()
        };
        assert!(usage.is_usage_only());
        folded.absorb(usage);
        assert_eq!(folded.text, "ab");
        assert_eq!(folded.finish_reason.as_deref(), Some("stop"));
        assert_eq!(folded.usage.unwrap().completion_tokens, 2);
    }
}

//! The only fields the proxy reads of a client's OpenAI request body, `model` and `stream`,
//! and the body with its `model` renamed (an alias resolved to the model served).
//!
//! The body is read by a visitor that keeps these two fields and skips every other one
//! without building it; the bytes themselves are forwarded unchanged, but for the renamed
//! `model` value.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use bytes::Bytes;
use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// `model` and `stream` of an OpenAI request body (each `None` when absent or `null`).
#[derive(Debug, Default)]
pub struct RequestFields<'a> {
    /// The requested model.
    pub model: Option<ModelName<'a>>,
    /// Whether the client asked for a server-sent-event stream.
    pub stream: Option<bool>,
}

/// A model name, borrowed from the body unless it contains escapes.
#[derive(Debug, Deserialize)]
pub struct ModelName<'a>(#[serde(borrow)] Cow<'a, str>);

impl ModelName<'_> {
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldsError {
    /// Not JSON at all (a syntax error, or cut short): serde's message.
    InvalidJson(String),
    /// JSON, but not an object whose `model` is a string and whose `stream` is a boolean
    /// (either may be absent or `null`, neither may be given twice): serde's message.
    InvalidShape(String),
}

/// The keys of a request body the proxy reads.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum Key {
    Model,
    Stream,
    #[serde(other)]
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for RequestFields<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Read from a JSON object only: a derived struct would also read an array, by
        // position.
        struct Fields<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for Fields<'a> {
            type Value = RequestFields<'a>;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut model: Option<Option<ModelName<'a>>> = None;
                let mut stream: Option<Option<bool>> = None;
                while let Some(key) = map.next_key::<Key>()? {
                    match key {
                        Key::Model if model.is_some() => {
                            return Err(de::Error::duplicate_field("model"));
                        }
                        Key::Stream if stream.is_some() => {
                            return Err(de::Error::duplicate_field("stream"));
                        }
                        Key::Model => model = Some(map.next_value()?),
                        Key::Stream => stream = Some(map.next_value()?),
                        Key::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(RequestFields {
                    model: model.flatten(),
                    stream: stream.flatten(),
                })
            }
        }
        deserializer.deserialize_map(Fields(PhantomData))
    }
}

/// Reads `model` and `stream` of a JSON body.
pub fn extract(body: &[u8]) -> Result<RequestFields<'_>, FieldsError> {
    serde_json::from_slice(body).map_err(|error| {
        // A wrong type can be met before a syntax error further on, and a number too large
        // for `stream` is a syntax error to serde: whether the body is JSON at all is told by
        // reading it whole, skipping every value.
        match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => FieldsError::InvalidShape(error.to_string()),
            Err(syntax) => FieldsError::InvalidJson(syntax.to_string()),
        }
    })
}

/// `body` with its `model` value replaced by `name`, every other byte as it was.
///
/// `model` is what [`extract`] read of `body` (else `body` is returned as it is). A name
/// borrowed from `body` itself (no escapes) is found by where it lies; any other by reading
/// the body's top-level keys.
pub fn with_model_name(body: &Bytes, model: &ModelName<'_>, name: &str) -> Bytes {
    let lies = match &model.0 {
        Cow::Borrowed(old) => {
            let start = (old.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
            let end = start.saturating_add(old.len());
            (start > 0 && end < body.len() && body[start - 1] == b'"' && body[end] == b'"')
                .then(|| (start - 1, end + 1))
        }
        Cow::Owned(_) => None,
    };
    let Some((start, end)) = lies.or_else(|| model_value(body)) else {
        return body.clone();
    };
    let quoted = serde_json::Value::from(name).to_string();
    let mut out = Vec::with_capacity(body.len() - (end - start) + quoted.len());
    out.extend_from_slice(&body[..start]);
    out.extend_from_slice(quoted.as_bytes());
    out.extend_from_slice(&body[end..]);
    Bytes::from(out)
}

/// Where the string value of the top-level key `model` of `body` (a JSON object, as
/// [`extract`] read it) lies, its quotes included.
fn model_value(body: &[u8]) -> Option<(usize, usize)> {
    let mut depth = 0usize;
    let mut at = 0;
    while at < body.len() {
        match body[at] {
            b'"' => {
                let end = string_end(body, at)?;
                let next = at_non_blank(body, end);
                // At the top level, a string followed by a colon is a key.
                if depth == 1 && body.get(next) == Some(&b':') {
                    let key: Cow<'_, str> = serde_json::from_slice(&body[at..end]).ok()?;
                    if key == "model" {
                        let value = at_non_blank(body, next + 1);
                        return (body.get(value) == Some(&b'"'))
                            .then(|| string_end(body, value))
                            .flatten()
                            .map(|end| (value, end));
                    }
                }
                at = end;
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.checked_sub(1)?,
            _ => {}
        }
        at += 1;
    }
    None
}

/// Just past the closing quote of the JSON string whose opening quote is at `start`.
fn string_end(body: &[u8], start: usize) -> Option<usize> {
    let mut at = start + 1;
    loop {
        at += memchr::memchr2(b'"', b'\\', body.get(at..)?)?;
        if body[at] == b'"' {
            return Some(at + 1);
        }
        at += 2;
    }
}

/// The first index from `at` on that holds no JSON blank.
fn at_non_blank(body: &[u8], at: usize) -> usize {
    let blanks = body
        .get(at..)
        .unwrap_or_default()
        .iter()
        .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .count();
    at + blanks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_model_and_stream_and_skips_the_rest() {
        let body = br#"{"messages":[{"role":"user","content":"hi \"there\""}],"model":"qwen3","stream":true,"n":{"deep":[1,2,{"x":null}]}}"#;
        let fields = extract(body).unwrap();
        let model = fields.model.unwrap();
        assert_eq!(model.as_str(), "qwen3");
        assert!(matches!(model.0, Cow::Borrowed(_)));
        assert_eq!(fields.stream, Some(true));
    }

    #[test]
    fn missing_fields_are_none() {
        let fields = extract(br#"{"messages":[]}"#).unwrap();
        assert!(fields.model.is_none());
        assert!(fields.stream.is_none());
        let null_model = extract(br#"{"model":null}"#).unwrap();
        assert!(null_model.model.is_none());
    }

    #[test]
    fn escaped_model_names_are_decoded() {
        let fields = extract(br#"{"model":"q\u0077en"}"#).unwrap();
        assert_eq!(fields.model.unwrap().as_str(), "qwen");
        let key = extract(br#"{"mod\u0065l":"qwen","str\u0065am":true}"#).unwrap();
        assert_eq!(key.model.unwrap().as_str(), "qwen");
        assert_eq!(key.stream, Some(true));
    }

    #[test]
    fn syntax_errors_and_wrong_types_are_told_apart() {
        for body in [
            &b""[..],
            b"{",
            b"not json",
            br#"{"model":"a",}"#,
            b"{\"model\":\"a\"} x",
            // A wrong type before the syntax error.
            br#"{"model":5,"#,
            br#"[{"model":"a"}"#,
        ] {
            assert!(
                matches!(extract(body), Err(FieldsError::InvalidJson(_))),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        for body in [
            &br#"[1,2]"#[..],
            br#"{"model":5}"#,
            br#"{"stream":"yes"}"#,
            b"\"text\"",
            // JSON, though serde reads no such number.
            br#"{"stream":1e400}"#,
        ] {
            assert!(
                matches!(extract(body), Err(FieldsError::InvalidShape(_))),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(extract(br#"{"model":"a","n":1e400}"#).is_ok());
    }

    #[test]
    fn arrays_are_not_read_as_objects() {
        // A derived struct reads `["qwen3", true]` as model `qwen3`, streamed.
        for body in [&br#"["qwen3",true]"#[..], br#"["qwen3"]"#, b"[]"] {
            assert!(
                matches!(extract(body), Err(FieldsError::InvalidShape(_))),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn fields_given_twice_are_refused() {
        for body in [
            &br#"{"model":"a","model":"b"}"#[..],
            br#"{"model":null,"model":"b"}"#,
            br#"{"stream":true,"mod\u0065l":"a","stream":false}"#,
        ] {
            assert!(
                matches!(extract(body), Err(FieldsError::InvalidShape(_))),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn alias_is_spliced_in_place() {
        let body = Bytes::from_static(br#"{"model": "q" , "messages":[{"content":"model q"}]}"#);
        let fields = extract(&body).unwrap();
        let renamed = with_model_name(&body, fields.model.as_ref().unwrap(), "qwen3-\"x\"");
        let expected = br#"{"model": "qwen3-\"x\"" , "messages":[{"content":"model q"}]}"#;
        assert_eq!(&renamed[..], expected);
        // Read from another copy of the body: found by its key.
        let copy = body.to_vec();
        let fields = extract(&copy).unwrap();
        let renamed = with_model_name(&body, fields.model.as_ref().unwrap(), "qwen3-\"x\"");
        assert_eq!(&renamed[..], expected);
    }

    #[test]
    fn escaped_alias_is_spliced_in_place_too() {
        let body = Bytes::from_static(
            br#"{"n":{"model":"x"},"a":"\"model\":","mod\u0065l" : "\u0071" ,"big":123456789012345678901234567890,"z":1e400}"#,
        );
        let fields = extract(&body).unwrap();
        assert_eq!(fields.model.as_ref().unwrap().as_str(), "q");
        let renamed = with_model_name(&body, fields.model.as_ref().unwrap(), "qwen3");
        // Re-serializing the document lost the big number's digits and refused 1e400
        // (leaving the alias in place): every byte but the value's is kept now.
        assert_eq!(
            &renamed[..],
            br#"{"n":{"model":"x"},"a":"\"model\":","mod\u0065l" : "qwen3" ,"big":123456789012345678901234567890,"z":1e400}"#
        );
    }
}

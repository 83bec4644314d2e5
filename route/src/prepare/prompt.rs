//! The `prompt` of a completions request, read without building the rest of the body, and
//! the `forward_token_ids` rewrite that replaces a string prompt by its token ids.
//!
//! OpenAI accepts four shapes: a string, a list of strings, a list of token ids, a list of
//! token-id lists. Routing uses one prompt: the string, the token ids, or the **first** element
//! of a list (a batch is served by one engine, and its first prompt is as good a key as any).

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;
use kvmesh_preprocess::CacheSalt;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};

/// The prompt routing uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Prompt<'a> {
    /// The prompt is one string, to tokenize (borrowed from the body when it has no escapes).
    Text(Cow<'a, str>),
    /// The prompt is a list of strings; this is the first, to tokenize.
    FirstText(Cow<'a, str>),
    /// Token ids (the prompt, or the first of a list), used as given.
    Tokens(Vec<u32>),
}

/// The `prompt` of [`completion_fields`].
#[cfg(test)]
pub(crate) fn completion_prompt(body: &[u8]) -> Result<Option<Prompt<'_>>, serde_json::Error> {
    completion_fields(body).map(|(prompt, _)| prompt)
}

/// Reads `prompt` and `cache_salt` from a completions body. The prompt is `None` when it is
/// absent, null or an empty list, and an error when it has none of the four shapes; the salt
/// never fails the body (see [`CacheSalt`]).
pub(crate) fn completion_fields(
    body: &[u8],
) -> Result<(Option<Prompt<'_>>, CacheSalt<'_>), serde_json::Error> {
    serde_json::from_slice::<CompletionBody<'_>>(body)
        .map(|body| (body.prompt.and_then(|p| p.0), body.cache_salt))
}

/// Reads `token_ids` and `cache_salt` from a body of vLLM's `/inference/v1/generate` (its
/// ids are a [`Prompt::Tokens`]; anything else is not routed by).
pub(crate) fn generate_fields(
    body: &[u8],
) -> Result<(Option<Prompt<'_>>, CacheSalt<'_>), serde_json::Error> {
    serde_json::from_slice::<GenerateBody<'_>>(body)
        .map(|body| (body.token_ids.and_then(|p| p.0), body.cache_salt))
}

/// Whether `body` is a JSON object with `messages` (a `/tokenize` body of the chat shape).
pub(crate) fn has_messages(body: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Messages {
        messages: Option<IgnoredAny>,
    }
    serde_json::from_slice::<Messages>(body).is_ok_and(|body| body.messages.is_some())
}

#[derive(Deserialize)]
struct GenerateBody<'a> {
    #[serde(borrow, default)]
    token_ids: Option<PromptField<'a>>,
    #[serde(borrow, default)]
    cache_salt: CacheSalt<'a>,
}

/// `body` with its string `prompt` replaced by `ids`, or `None` when `text` is not the body's
/// string prompt (then nothing is rewritten). Only for [`Prompt::Text`]: a list's first
/// element must not be replaced alone.
///
/// A prompt borrowed from the body (no escapes) is spliced in place, leaving every other byte
/// as it was; an escaped one falls back to re-serializing the document.
pub(crate) fn with_token_prompt(body: &Bytes, text: &str, ids: &[u32]) -> Option<Bytes> {
    let array = serde_json::to_string(ids).ok()?;
    let start = (text.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
    let end = start.wrapping_add(text.len());
    // A text borrowed from the body lies inside it, between its quotes; a decoded (escaped)
    // one is a separate allocation, outside it.
    if start > 0 && end < body.len() && body[start - 1] == b'"' && body[end] == b'"' {
        let mut out = Vec::with_capacity(body.len() + array.len());
        out.extend_from_slice(&body[..start - 1]);
        out.extend_from_slice(array.as_bytes());
        out.extend_from_slice(&body[end + 1..]);
        return Some(Bytes::from(out));
    }
    let mut object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(body).ok()?;
    let slot = object.get_mut("prompt")?;
    if slot.as_str() != Some(text) {
        return None;
    }
    *slot = serde_json::Value::from(ids);
    serde_json::to_vec(&object).ok().map(Bytes::from)
}

#[derive(Deserialize)]
struct CompletionBody<'a> {
    #[serde(borrow, default)]
    prompt: Option<PromptField<'a>>,
    #[serde(borrow, default)]
    cache_salt: CacheSalt<'a>,
}

/// The `prompt` value: `None` for an empty list.
struct PromptField<'a>(Option<Prompt<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for PromptField<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor)
    }
}

const SHAPES: &str = "a string, a list of strings, a list of token ids or a list of token-id lists";

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptField<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(SHAPES)
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(PromptField(Some(Prompt::Text(Cow::Borrowed(v)))))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PromptField(Some(Prompt::Text(Cow::Owned(v.to_owned())))))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(PromptField(Some(Prompt::Text(Cow::Owned(v)))))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let prompt = match seq.next_element::<FirstItem<'de>>()? {
            None => return Ok(PromptField(None)),
            Some(FirstItem::Token(first)) => {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0) + 1);
                ids.push(first);
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                return Ok(PromptField(Some(Prompt::Tokens(ids))));
            }
            Some(FirstItem::Text(text)) => Prompt::FirstText(text),
            Some(FirstItem::Tokens(ids)) => Prompt::Tokens(ids),
        };
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(PromptField(Some(prompt)))
    }
}

/// The first element of a prompt list.
enum FirstItem<'a> {
    Token(u32),
    Text(Cow<'a, str>),
    Tokens(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for FirstItem<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(FirstItemVisitor)
    }
}

struct FirstItemVisitor;

impl<'de> Visitor<'de> for FirstItemVisitor {
    type Value = FirstItem<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id, a string or a list of token ids")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        u32::try_from(v)
            .map(FirstItem::Token)
            .map_err(|_| E::custom(format!("token id {v} does not fit in 32 bits")))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        u32::try_from(v)
            .map(FirstItem::Token)
            .map_err(|_| E::custom(format!("invalid token id {v}")))
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(FirstItem::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(FirstItem::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(FirstItem::Text(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(id) = seq.next_element::<u32>()? {
            ids.push(id);
        }
        Ok(FirstItem::Tokens(ids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(body: &str) -> Option<Prompt<'_>> {
        completion_prompt(body.as_bytes()).unwrap()
    }

    #[test]
    fn reads_every_prompt_shape() {
        assert_eq!(
            prompt(r#"{"model":"m","prompt":"hello","max_tokens":3}"#),
            Some(Prompt::Text(Cow::Borrowed("hello")))
        );
        assert_eq!(
            prompt(r#"{"prompt":[1,2,3],"n":{"deep":[1]}}"#),
            Some(Prompt::Tokens(vec![1, 2, 3]))
        );
        assert_eq!(
            prompt(r#"{"prompt":["first","second"]}"#),
            Some(Prompt::FirstText(Cow::Borrowed("first")))
        );
        assert_eq!(
            prompt(r#"{"prompt":[[7,8],[9]]}"#),
            Some(Prompt::Tokens(vec![7, 8]))
        );
        assert_eq!(prompt(r#"{"prompt":[]}"#), None);
        assert_eq!(prompt(r#"{"prompt":null}"#), None);
        assert_eq!(prompt(r#"{"model":"m"}"#), None);
        assert!(matches!(
            prompt(r#"{"prompt":"tab\tand \u00e9"}"#),
            Some(Prompt::Text(Cow::Owned(text))) if text == "tab\tand é"
        ));
    }

    #[test]
    fn reads_the_cache_salt_beside_the_prompt() {
        let salt = |body: &str| {
            let (_, salt) = completion_fields(body.as_bytes()).unwrap();
            salt.as_deref().map(str::to_owned)
        };
        assert_eq!(
            salt(r#"{"cache_salt":"t","prompt":"x"}"#),
            Some("t".to_owned())
        );
        assert_eq!(
            salt(r#"{"prompt":"x","cache_salt":"t"}"#),
            Some("t".to_owned())
        );
        assert_eq!(salt(r#"{"prompt":"x"}"#), None);
        assert_eq!(salt(r#"{"prompt":"x","cache_salt":{"a":[1]}}"#), None);
        assert_eq!(salt(r#"{"prompt":"x","cache_salt":""}"#), None);
    }

    #[test]
    fn rejects_other_shapes() {
        for body in [
            r#"{"prompt":5}"#,
            r#"{"prompt":{"a":1}}"#,
            r#"{"prompt":[-1]}"#,
            r#"{"prompt":[1,"x"]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":[[1],"x"]}"#,
        ] {
            let parsed = completion_prompt(body.as_bytes());
            // A list whose later elements differ in kind is still routed by its first one.
            if body == r#"{"prompt":[[1],"x"]}"# {
                assert_eq!(parsed.unwrap(), Some(Prompt::Tokens(vec![1])));
            } else {
                assert!(parsed.is_err(), "{body}");
            }
        }
    }

    #[test]
    fn string_prompts_are_spliced_into_token_ids() {
        let body = Bytes::from_static(br#"{"model": "m" , "prompt":"hi there", "x": "prompt"}"#);
        let Some(Prompt::Text(text)) = completion_prompt(&body).unwrap() else {
            panic!("text prompt");
        };
        let rewritten = with_token_prompt(&body, &text, &[5, 6]).unwrap();
        assert_eq!(
            &rewritten[..],
            br#"{"model": "m" , "prompt":[5,6], "x": "prompt"}"#
        );
    }

    #[test]
    fn escaped_prompts_fall_back_to_reserializing() {
        let body = Bytes::from_static(br#"{"prompt":"a\nb","max_tokens":2}"#);
        let Some(Prompt::Text(text)) = completion_prompt(&body).unwrap() else {
            panic!("text prompt");
        };
        let rewritten = with_token_prompt(&body, &text, &[1]).unwrap();
        let value: serde_json::Value = serde_json::from_slice(&rewritten).unwrap();
        assert_eq!(value, serde_json::json!({"prompt": [1], "max_tokens": 2}));
        let other = Bytes::from_static(br#"{"prompt":"c"}"#);
        assert_eq!(with_token_prompt(&other, &text, &[1]), None);
    }
}

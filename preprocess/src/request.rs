//! [`ChatRequest`]: a borrowed view of the parts of a chat-completions body that the template sees.

use std::borrow::Cow;
use std::fmt;

use minijinja::Value;
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::error::{PreprocessError, Result};

/// The fields of an OpenAI chat-completions request body that decide the rendered prompt:
/// `messages`, `tools`, `add_generation_prompt` and `chat_template_kwargs`, plus `cache_salt`,
/// which decides its block hashes. Every other field is skipped without being parsed. Message texts borrow from the body where JSON escapes allow.
#[derive(Debug, Deserialize)]
pub struct ChatRequest<'a> {
    #[serde(borrow)]
    pub(crate) messages: Vec<ChatMessage<'a>>,
    #[serde(default)]
    pub(crate) tools: Option<Vec<Value>>,
    #[serde(default)]
    pub(crate) add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub(crate) chat_template_kwargs: Option<Value>,
    /// Not a template field: the prefix-cache namespace the block hashes must carry.
    #[serde(default, borrow)]
    pub(crate) cache_salt: CacheSalt<'a>,
}

impl<'a> ChatRequest<'a> {
    /// Parses a raw request body. A body that is not a JSON object with a `messages` list of
    /// message objects gives [`PreprocessError::InvalidRequest`].
    pub fn from_slice(body: &'a [u8]) -> Result<Self> {
        serde_json::from_slice(body).map_err(|e| PreprocessError::InvalidRequest(e.to_string()))
    }

    /// The number of messages.
    pub fn message_count(&self) -> usize {
        self.messages.len()
    }

    /// The request's `cache_salt` (see [`CacheSalt`]).
    pub fn cache_salt(&self) -> Option<&str> {
        self.cache_salt.as_deref()
    }
}

/// A request's `cache_salt`: vLLM's per-request prefix-cache namespace (chat and completions
/// bodies), which vLLM folds into the hash of the prompt's first block, so prompts under
/// different salts share no cached block. `Some` only for a non-empty string (borrowed from
/// the body unless it has escapes); absent, null, empty or any other type is `None`, and never
/// fails the body (the engine judges such a value, and vLLM salts nothing with an empty one).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CacheSalt<'a>(Option<Cow<'a, str>>);

impl CacheSalt<'_> {
    /// The salt, when there is one.
    pub fn as_deref(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

struct CacheSaltVisitor;

impl<'de> Visitor<'de> for CacheSaltVisitor {
    type Value = CacheSalt<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(CacheSalt((!v.is_empty()).then_some(Cow::Borrowed(v))))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(CacheSalt((!v.is_empty()).then(|| Cow::Owned(v.to_owned()))))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(CacheSalt((!v.is_empty()).then_some(Cow::Owned(v))))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(CacheSalt(None))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(CacheSalt(None))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(CacheSalt(None))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(CacheSalt(None))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(CacheSalt(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(CacheSalt(None))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(CacheSalt(None))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for CacheSalt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CacheSaltVisitor)
    }
}

/// One chat message: only the fields vLLM hands to the template.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatMessage<'a> {
    #[serde(borrow)]
    pub(crate) role: Cow<'a, str>,
    #[serde(default, borrow)]
    pub(crate) content: Option<MessageContent<'a>>,
    #[serde(default, borrow)]
    pub(crate) reasoning: Option<JsonStr<'a>>,
    #[serde(default, borrow)]
    pub(crate) reasoning_content: Option<JsonStr<'a>>,
    #[serde(default)]
    pub(crate) tool_calls: Option<Value>,
    #[serde(default, borrow)]
    pub(crate) tool_call_id: Option<JsonStr<'a>>,
    #[serde(default, borrow)]
    pub(crate) name: Option<JsonStr<'a>>,
}

/// A JSON string that borrows from the body when it has no escapes.
#[derive(Debug)]
pub(crate) struct JsonStr<'a>(pub(crate) Cow<'a, str>);

impl JsonStr<'_> {
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

struct JsonStrVisitor;

impl<'de> Visitor<'de> for JsonStrVisitor {
    type Value = JsonStr<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(JsonStr(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(JsonStr(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(JsonStr(Cow::Owned(v)))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for JsonStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(JsonStrVisitor)
    }
}

/// A message's `content`: a string or a list of content parts.
#[derive(Debug)]
pub(crate) enum MessageContent<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<ContentPart<'a>>),
}

struct ContentVisitor;

impl<'de> Visitor<'de> for ContentVisitor {
    type Value = MessageContent<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or a list of content parts")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(MessageContent::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(MessageContent::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(MessageContent::Text(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        Vec::deserialize(SeqAccessDeserializer::new(seq)).map(MessageContent::Parts)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for MessageContent<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ContentVisitor)
    }
}

/// One element of a content list: a bare string or a typed part object.
#[derive(Debug)]
pub(crate) enum ContentPart<'a> {
    Text(Cow<'a, str>),
    Typed(TypedPart<'a>),
}

/// A typed content part; media payloads are skipped, only their presence is noted.
#[derive(Debug, Deserialize)]
pub(crate) struct TypedPart<'a> {
    #[serde(default, rename = "type", borrow)]
    pub(crate) kind: Option<JsonStr<'a>>,
    #[serde(default, borrow)]
    pub(crate) text: Option<JsonStr<'a>>,
    #[serde(default, borrow)]
    pub(crate) refusal: Option<JsonStr<'a>>,
    #[serde(default, borrow)]
    pub(crate) thinking: Option<JsonStr<'a>>,
    #[serde(default)]
    image_url: Option<IgnoredAny>,
    #[serde(default)]
    input_audio: Option<IgnoredAny>,
    #[serde(default)]
    audio_url: Option<IgnoredAny>,
    #[serde(default)]
    video_url: Option<IgnoredAny>,
    #[serde(default)]
    image_embeds: Option<IgnoredAny>,
    #[serde(default)]
    audio_embeds: Option<IgnoredAny>,
}

impl TypedPart<'_> {
    /// True when the part carries an image, audio or video payload.
    pub(crate) fn has_media(&self) -> bool {
        self.image_url.is_some()
            || self.input_audio.is_some()
            || self.audio_url.is_some()
            || self.video_url.is_some()
            || self.image_embeds.is_some()
            || self.audio_embeds.is_some()
    }
}

struct PartVisitor;

impl<'de> Visitor<'de> for PartVisitor {
    type Value = ContentPart<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or a content part object")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(ContentPart::Text(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(ContentPart::Text(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(ContentPart::Text(Cow::Owned(v)))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        TypedPart::deserialize(MapAccessDeserializer::new(map)).map(ContentPart::Typed)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for ContentPart<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PartVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_only_the_template_fields() {
        let body = br#"{"model": "m", "stream": true, "temperature": 0.2, "n": [1, {"x": 2}],
            "messages": [{"role": "user", "content": "hi", "extra": {"deep": [1]}}],
            "add_generation_prompt": false, "chat_template_kwargs": {"enable_thinking": false}}"#;
        let req = ChatRequest::from_slice(body).unwrap();
        assert_eq!(req.message_count(), 1);
        assert_eq!(req.add_generation_prompt, Some(false));
        assert!(req.tools.is_none());
        let kwargs = req.chat_template_kwargs.unwrap();
        assert!(!kwargs.get_attr("enable_thinking").unwrap().is_true());
    }

    #[test]
    fn plain_strings_are_borrowed_and_escaped_ones_owned() {
        let body = br#"{"messages": [{"role": "user", "content": "plain"},
            {"role": "user", "content": "esc\n"}, {"role": "user", "content": [{"type": "text", "text": "part"}]}]}"#;
        let req = ChatRequest::from_slice(body).unwrap();
        assert!(matches!(
            req.messages[0].content,
            Some(MessageContent::Text(Cow::Borrowed("plain")))
        ));
        assert!(matches!(
            &req.messages[1].content,
            Some(MessageContent::Text(Cow::Owned(s))) if s == "esc\n"
        ));
        let Some(MessageContent::Parts(parts)) = &req.messages[2].content else {
            panic!("expected parts");
        };
        let ContentPart::Typed(part) = &parts[0] else {
            panic!("expected a typed part");
        };
        assert!(matches!(part.text, Some(JsonStr(Cow::Borrowed("part")))));
        assert!(!part.has_media());
    }

    #[test]
    fn media_parts_are_noticed() {
        let body = br#"{"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:..."}}, "bare"]}]}"#;
        let req = ChatRequest::from_slice(body).unwrap();
        let Some(MessageContent::Parts(parts)) = &req.messages[0].content else {
            panic!("expected parts");
        };
        assert!(matches!(&parts[0], ContentPart::Typed(p) if p.has_media()));
        assert!(matches!(
            &parts[1],
            ContentPart::Text(Cow::Borrowed("bare"))
        ));
    }

    #[test]
    fn cache_salt_is_read_and_never_fails_the_body() {
        let salt = |body: &str| {
            ChatRequest::from_slice(body.as_bytes())
                .expect("a valid body")
                .cache_salt()
                .map(str::to_owned)
        };
        let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
        let with = |v: &str| format!("{{{msgs}, \"cache_salt\": {v}}}");
        assert_eq!(salt(&with(r#""tenant-a""#)), Some("tenant-a".into()));
        assert_eq!(salt(&with(r#""t\u0041""#)), Some("tA".into()));
        assert_eq!(salt(&format!("{{{msgs}}}")), None);
        let others = [
            "null",
            r#""""#,
            "5",
            "-1.5",
            "true",
            "[1, [2]]",
            r#"{"a": {"b": 1}}"#,
        ];
        for v in others {
            assert_eq!(salt(&with(v)), None, "{v}");
        }
        let body = with(r#""b""#);
        let req = ChatRequest::from_slice(body.as_bytes()).unwrap();
        assert!(matches!(req.cache_salt.0, Some(Cow::Borrowed("b"))));
    }

    #[test]
    fn null_content_is_none() {
        let req =
            ChatRequest::from_slice(br#"{"messages": [{"role": "assistant", "content": null}]}"#)
                .unwrap();
        assert!(req.messages[0].content.is_none());
    }

    #[test]
    fn invalid_bodies_are_client_errors() {
        for body in [
            &b"not json"[..],
            br#"{"model": "m"}"#,
            br#"{"messages": "hi"}"#,
            br#"{"messages": [{"content": "no role"}]}"#,
            br#"{"messages": [{"role": "user", "content": 5}]}"#,
        ] {
            let err = ChatRequest::from_slice(body).unwrap_err();
            assert!(err.is_client_error(), "{err}");
        }
    }
}

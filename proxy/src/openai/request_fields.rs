//! The only request body fields the proxy reads: `model` and `stream`.
//!
//! The body is deserialized into a borrowed struct that skips every other
//! field without building it; the bytes themselves are forwarded unchanged.

use std::borrow::Cow;

use bytes::Bytes;

use serde::Deserialize;

/// `model` and `stream` of an OpenAI request body.
#[derive(Debug, Deserialize)]
pub(crate) struct RequestFields<'a> {
    /// The requested model.
    #[serde(borrow, default)]
    pub(crate) model: Option<ModelName<'a>>,
    /// Whether the client asked for a server-sent-event stream.
    #[serde(default)]
    pub(crate) stream: Option<bool>,
}

/// A model name, borrowed from the body unless it contains escapes.
#[derive(Debug, Deserialize)]
pub(crate) struct ModelName<'a>(#[serde(borrow)] pub(crate) Cow<'a, str>);

impl ModelName<'_> {
    /// The name.
    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// Why a body was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FieldsError {
    /// Not JSON at all (syntax error or truncated).
    InvalidJson(String),
    /// JSON, but not an object with a string `model` and boolean `stream`.
    InvalidShape(String),
}

/// Extracts `model` and `stream` from a JSON body.
pub(crate) fn extract(body: &[u8]) -> Result<RequestFields<'_>, FieldsError> {
    serde_json::from_slice(body).map_err(|error| {
        let message = error.to_string();
        if error.is_data() {
            FieldsError::InvalidShape(message)
        } else {
            FieldsError::InvalidJson(message)
        }
    })
}

/// `body` with its `model` value replaced by `name`.
///
/// `model` must come from [`extract`] over the same `body`. A name borrowed
/// from the body (no escapes) is spliced in place, leaving every other byte as
/// it was; an escaped one falls back to re-serializing the document.
pub(crate) fn with_model_name(body: &Bytes, model: &ModelName<'_>, name: &str) -> Bytes {
    let quoted = serde_json::Value::from(name).to_string();
    if let Cow::Borrowed(old) = &model.0 {
        let start = (old.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
        let end = start + old.len();
        if start > 0 && end < body.len() && body[start - 1] == b'"' && body[end] == b'"' {
            let mut out = Vec::with_capacity(body.len() + quoted.len());
            out.extend_from_slice(&body[..start - 1]);
            out.extend_from_slice(quoted.as_bytes());
            out.extend_from_slice(&body[end + 1..]);
            return Bytes::from(out);
        }
    }
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body) {
        Ok(mut object) => {
            object.insert("model".to_string(), serde_json::Value::from(name));
            Bytes::from(serde_json::Value::Object(object).to_string())
        }
        Err(_) => body.clone(),
    }
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
    }

    #[test]
    fn syntax_errors_and_wrong_types_are_told_apart() {
        for body in [
            &b""[..],
            b"{",
            b"not json",
            br#"{"model":"a",}"#,
            b"{\"model\":\"a\"} x",
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
        assert_eq!(
            &renamed[..],
            br#"{"model": "qwen3-\"x\"" , "messages":[{"content":"model q"}]}"#
        );
    }

    #[test]
    fn escaped_alias_falls_back_to_reserializing() {
        let body = Bytes::from_static(br#"{"model":"\u0071","n":1}"#);
        let fields = extract(&body).unwrap();
        let renamed = with_model_name(&body, fields.model.as_ref().unwrap(), "qwen3");
        let value: serde_json::Value = serde_json::from_slice(&renamed).unwrap();
        assert_eq!(value, serde_json::json!({"model": "qwen3", "n": 1}));
    }
}

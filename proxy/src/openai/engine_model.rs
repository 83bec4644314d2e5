//! The model of a request on an engine route (`engine_routes`): the JSON body's `model`,
//! else the multipart body's `model` field (within its first [`MULTIPART_WINDOW`] bytes),
//! else a `model` query parameter, else an `x-kvmesh-model` header, else the only model
//! the proxy serves.

use std::borrow::Cow;

use bytes::Bytes;
use futures_util::FutureExt;
use kvmesh_wire::request_fields::{FieldsError, ModelName, extract};

/// How much of a multipart body is searched for its `model` field (audio clients send it
/// before the file).
pub(crate) const MULTIPART_WINDOW: usize = 64 * 1024;

/// The header naming the model of a request whose body does not.
pub(crate) const MODEL_HEADER: &str = "x-kvmesh-model";

/// Where an engine route's request names its model, and whether it asks for a stream.
#[derive(Debug)]
pub(crate) enum Named<'a> {
    /// The JSON body's `model`: an alias there is rewritten like on kvmesh's own routes.
    Body(ModelName<'a>, bool),
    /// Elsewhere (a form field, the query, the header): forwarded as it is.
    Outside(Cow<'a, str>, bool),
    /// Nowhere.
    Nowhere,
}

/// Finds the model of a request with `body` (its `content_type`), `query` and the value of
/// its [`MODEL_HEADER`]. A body declared JSON must be a JSON object.
pub(crate) fn named_model<'a>(
    body: &'a Bytes,
    content_type: Option<&str>,
    query: Option<&'a str>,
    header: Option<&'a str>,
) -> Result<Named<'a>, FieldsError> {
    let essence = content_type
        .and_then(|value| value.split(';').next())
        .map(|essence| essence.trim().to_ascii_lowercase());
    let mut stream = false;
    match essence.as_deref() {
        Some("application/json") => {
            let fields = extract(body)?;
            stream = fields.stream.unwrap_or(false);
            if let Some(model) = fields.model {
                return Ok(Named::Body(model, stream));
            }
        }
        Some("multipart/form-data") => {
            let form = content_type.and_then(|value| form_fields(body, value));
            if let Some((model, streamed)) = form {
                stream = streamed;
                if let Some(model) = model {
                    return Ok(Named::Outside(Cow::Owned(model), stream));
                }
            }
        }
        // No type: a body that looks like JSON is read as JSON, if it is.
        None if body.first() == Some(&b'{') => {
            if let Ok(fields) = extract(body) {
                stream = fields.stream.unwrap_or(false);
                if let Some(model) = fields.model {
                    return Ok(Named::Body(model, stream));
                }
            }
        }
        _ => {}
    }
    let from_query = query.and_then(|query| {
        query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(name, _)| *name == "model")
            .map(|(_, value)| percent_decoded(value))
    });
    match from_query.or(header.map(Cow::Borrowed)) {
        Some(model) if !model.is_empty() => Ok(Named::Outside(model, stream)),
        _ => Ok(Named::Nowhere),
    }
}

/// The `model` and `stream` fields of a multipart body within its first
/// [`MULTIPART_WINDOW`] bytes (`None`: no boundary in `content_type`).
fn form_fields(body: &Bytes, content_type: &str) -> Option<(Option<String>, bool)> {
    let boundary = multer::parse_boundary(content_type).ok()?;
    let window = body.slice(..body.len().min(MULTIPART_WINDOW));
    let chunks = futures_util::stream::once(async move { Ok::<_, std::io::Error>(window) });
    let mut form = multer::Multipart::new(chunks, boundary);
    let (mut model, mut stream) = (None, false);
    // The body is in memory: every step completes at once (a step that would wait means
    // the window ended inside a part, and the search ends there).
    while let Some(Ok(Some(field))) = form.next_field().now_or_never() {
        let name = field.name().map(str::to_owned);
        let Some(Ok(value)) = field.text().now_or_never() else {
            break;
        };
        match name.as_deref() {
            Some("model") => model = Some(value),
            Some("stream") => stream = value.trim() == "true",
            _ => {}
        }
        if model.is_some() && stream {
            break;
        }
    }
    Some((model, stream))
}

/// `value` with its `%XX` escapes and `+` decoded (a query parameter's value).
fn percent_decoded(value: &str) -> Cow<'_, str> {
    if !value.contains(['%', '+']) {
        return Cow::Borrowed(value);
    }
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let hex = |i: usize| bytes.get(i).and_then(|b| (*b as char).to_digit(16));
        match bytes[at] {
            b'%' if hex(at + 1).is_some() && hex(at + 2).is_some() => {
                let high = hex(at + 1).unwrap_or(0);
                let low = hex(at + 2).unwrap_or(0);
                out.push((high * 16 + low) as u8);
                at += 3;
            }
            b'+' => {
                out.push(b' ');
                at += 1;
            }
            byte => {
                out.push(byte);
                at += 1;
            }
        }
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(named: Named<'_>) -> Option<(String, bool, bool)> {
        match named {
            Named::Body(model, stream) => Some((model.as_str().to_string(), stream, true)),
            Named::Outside(model, stream) => Some((model.into_owned(), stream, false)),
            Named::Nowhere => None,
        }
    }

    fn form(parts: &[(&str, &str)]) -> Bytes {
        let mut body = String::new();
        for (field, value) in parts {
            body.push_str(&format!(
                "--XyZ\r\nContent-Disposition: form-data; name=\"{field}\"\r\n\r\n{value}\r\n"
            ));
        }
        body.push_str("--XyZ--\r\n");
        Bytes::from(body)
    }

    const FORM: &str = "multipart/form-data; boundary=XyZ";

    #[test]
    fn a_json_body_names_its_model_first() {
        let body = Bytes::from_static(br#"{"model":"m","stream":true,"prompt":"x"}"#);
        let named = named_model(&body, Some("application/json"), Some("model=q"), Some("h"));
        assert_eq!(name(named.unwrap()), Some(("m".into(), true, true)));
        let bare = Bytes::from_static(br#"{"prompt":"x"}"#);
        let named = named_model(
            &bare,
            Some("application/json; charset=utf-8"),
            None,
            Some("h"),
        );
        assert_eq!(name(named.unwrap()), Some(("h".into(), false, false)));
        let broken = Bytes::from_static(b"{\"model\":");
        assert!(named_model(&broken, Some("application/json"), None, None).is_err());
    }

    #[test]
    fn a_form_names_its_model_in_a_field() {
        let body = form(&[
            ("model", "whisper"),
            ("stream", "true"),
            ("file", "RIFF...."),
        ]);
        let named = named_model(&body, Some(FORM), Some("model=q"), None);
        assert_eq!(name(named.unwrap()), Some(("whisper".into(), true, false)));
        // After the window, the field is not looked for: the query names it.
        let late = form(&[
            ("file", &"a".repeat(MULTIPART_WINDOW)),
            ("model", "whisper"),
        ]);
        let named = named_model(&late, Some(FORM), Some("model=q"), None);
        assert_eq!(name(named.unwrap()), Some(("q".into(), false, false)));
        let named = named_model(&late, Some(FORM), None, None);
        assert_eq!(name(named.unwrap()), None);
    }

    #[test]
    fn the_query_then_the_header() {
        let empty = Bytes::new();
        let named = named_model(&empty, None, Some("a=1&model=my%20model+x"), Some("h"));
        assert_eq!(
            name(named.unwrap()),
            Some(("my model x".into(), false, false))
        );
        let named = named_model(&empty, None, Some("a=1"), Some("h"));
        assert_eq!(name(named.unwrap()), Some(("h".into(), false, false)));
        let named = named_model(&empty, Some("text/plain"), None, None);
        assert_eq!(name(named.unwrap()), None);
    }
}

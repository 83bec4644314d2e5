//! Request and response heads parsed in place: httparse finds the fields, and a head keeps
//! their positions in its own bytes (no header map, no copy per field).

use std::ops::Range;

use bytes::{Bytes, BytesMut};

/// Most header fields a head may have on the fast path (more: pingora's path answers it).
pub(crate) const MAX_FIELDS: usize = 64;

/// A header field: the positions of its name and value in the head's bytes.
#[derive(Debug, Clone)]
struct Field {
    name: Range<usize>,
    value: Range<usize>,
}

/// The fields of one head, over the head's bytes.
#[derive(Debug, Clone, Default)]
pub(crate) struct Fields {
    bytes: Bytes,
    fields: Vec<Field>,
}

/// The position of `part` (a slice of the buffer at `base`) in that buffer.
fn span(base: usize, part: &[u8]) -> Range<usize> {
    let start = part.as_ptr() as usize - base;
    start..start + part.len()
}

/// The positions of httparse's fields in the buffer at `base`.
fn spans(base: usize, parsed: &[httparse::Header<'_>]) -> Vec<Field> {
    parsed
        .iter()
        .map(|field| Field {
            name: span(base, field.name.as_bytes()),
            value: span(base, field.value),
        })
        .collect()
}

impl Fields {
    /// Every field as (name, value), in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.fields.iter().map(|field| {
            (
                &self.bytes[field.name.clone()],
                &self.bytes[field.value.clone()],
            )
        })
    }

    /// The value of the first field called `name` (ASCII case-insensitive).
    pub(crate) fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(field, _)| field.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, value)| value)
    }

    /// Whether any field is called `name`.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// How many fields there are.
    pub(crate) fn len(&self) -> usize {
        self.fields.len()
    }
}

/// A parsed HTTP/1 request head.
#[derive(Debug, Clone)]
pub(crate) struct RequestHead {
    method: Range<usize>,
    target: Range<usize>,
    /// The minor version (`1` for HTTP/1.1).
    pub(crate) minor_version: u8,
    /// The header fields.
    pub(crate) fields: Fields,
}

impl RequestHead {
    /// The method, as sent.
    pub(crate) fn method(&self) -> &[u8] {
        &self.fields.bytes[self.method.clone()]
    }

    /// The request target (path and query), as sent.
    pub(crate) fn target(&self) -> &[u8] {
        &self.fields.bytes[self.target.clone()]
    }

    /// The whole head, as received.
    pub(crate) fn raw(&self) -> &Bytes {
        &self.fields.bytes
    }

    /// The path: the target without its query.
    pub(crate) fn path(&self) -> &str {
        let target = self.target();
        let end = target.iter().position(|&byte| byte == b'?');
        // httparse accepts only visible ASCII in the target.
        std::str::from_utf8(&target[..end.unwrap_or(target.len())]).unwrap_or("")
    }
}

/// A parsed HTTP/1 response head.
#[derive(Debug, Clone)]
pub(crate) struct ResponseHead {
    /// The status code.
    pub(crate) status: u16,
    /// The minor version (`0` for HTTP/1.0).
    pub(crate) minor_version: u8,
    /// The header fields.
    pub(crate) fields: Fields,
}

/// What parsing a buffer's start found.
#[derive(Debug)]
pub(crate) enum Parsed<T> {
    /// A whole head.
    Complete(T),
    /// Not all of the head has arrived.
    Partial,
    /// Not a valid head, or more than [`MAX_FIELDS`] fields.
    Invalid,
}

/// Parses the request head at the start of `buf`; a complete head is split off it.
pub(crate) fn parse_request(buf: &mut BytesMut) -> Parsed<RequestHead> {
    let base = buf.as_ptr() as usize;
    let mut parsed = [httparse::EMPTY_HEADER; MAX_FIELDS];
    let mut request = httparse::Request::new(&mut parsed);
    let length = match request.parse(buf) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Invalid,
    };
    let (Some(method), Some(target), Some(minor_version)) =
        (request.method, request.path, request.version)
    else {
        return Parsed::Invalid;
    };
    let method = span(base, method.as_bytes());
    let target = span(base, target.as_bytes());
    let fields = spans(base, request.headers);
    // Splitting keeps the bytes where they are, so the positions stay valid.
    let bytes = buf.split_to(length).freeze();
    Parsed::Complete(RequestHead {
        method,
        target,
        minor_version,
        fields: Fields { bytes, fields },
    })
}

/// Parses the response head at the start of `buf`; a complete head is split off it.
pub(crate) fn parse_response(buf: &mut BytesMut) -> Parsed<ResponseHead> {
    let base = buf.as_ptr() as usize;
    let mut parsed = [httparse::EMPTY_HEADER; MAX_FIELDS];
    let mut response = httparse::Response::new(&mut parsed);
    let length = match response.parse(buf) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Invalid,
    };
    let (Some(status), Some(minor_version)) = (response.code, response.version) else {
        return Parsed::Invalid;
    };
    let fields = spans(base, response.headers);
    let bytes = buf.split_to(length).freeze();
    Parsed::Complete(ResponseHead {
        status,
        minor_version,
        fields: Fields { bytes, fields },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_fields_are_found_in_any_case() {
        let raw =
            b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}";
        let mut buf = BytesMut::from(&raw[..]);
        let Parsed::Complete(head) = parse_request(&mut buf) else {
            panic!("not parsed");
        };
        assert_eq!(head.raw().len(), raw.len() - 2);
        assert_eq!(&buf[..], b"{}");
        assert_eq!(head.method(), b"POST");
        assert_eq!(head.path(), "/v1/chat/completions");
        assert_eq!(head.target(), b"/v1/chat/completions?x=1");
        assert_eq!(head.minor_version, 1);
        assert_eq!(head.fields.get("content-length"), Some(&b"2"[..]));
        assert_eq!(head.fields.len(), 2);
        assert!(head.fields.get("x-missing").is_none());
    }

    #[test]
    fn partial_and_invalid_heads_are_told_apart() {
        let parse = |raw: &[u8]| parse_request(&mut BytesMut::from(raw));
        assert!(matches!(parse(b"POST / HTTP/1.1\r\nHo"), Parsed::Partial));
        assert!(matches!(
            parse(b"POST / HTTP/1.1\r\n\x01: x\r\n\r\n"),
            Parsed::Invalid
        ));
        let many: String = (0..=MAX_FIELDS).map(|i| format!("x-{i}: 1\r\n")).collect();
        let raw = format!("POST / HTTP/1.1\r\n{many}\r\n");
        assert!(matches!(parse(raw.as_bytes()), Parsed::Invalid));
    }

    #[test]
    fn response_heads_keep_status_and_fields() {
        let raw = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        let mut buf = BytesMut::from(&raw[..]);
        let Parsed::Complete(head) = parse_response(&mut buf) else {
            panic!("not parsed");
        };
        assert_eq!((head.status, head.minor_version), (200, 1));
        assert_eq!(&buf[..], b"hello");
        assert_eq!(head.fields.get("Content-Length"), Some(&b"5"[..]));
    }
}

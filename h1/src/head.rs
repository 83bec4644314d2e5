//! Request and response heads parsed in place: httparse finds the fields, and a head keeps
//! their positions in its own bytes (no header map, no copy per field).

use std::ops::Range;

use bytes::{Bytes, BytesMut};

/// Header fields a head is first parsed with room for (on the stack).
const MAX_FIELDS: usize = 64;

/// Most header fields a request head may have (a head with more is [`Parsed::Invalid`]);
/// one with more than [`MAX_FIELDS`] is parsed again with this room. The same as pingora's
/// limit and `limits.max_headers`' largest value.
const MAX_REQUEST_FIELDS: usize = 256;

/// A header field: the positions of its name and value in the head's bytes.
#[derive(Debug, Clone)]
struct Field {
    name: Range<usize>,
    value: Range<usize>,
}

/// The fields kvmesh looks at, found once per head (a lookup is an array index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Known {
    /// `Content-Length`.
    ContentLength,
    /// `Transfer-Encoding`.
    TransferEncoding,
    /// `Expect`.
    Expect,
    /// `Connection`.
    Connection,
    /// `X-Request-Id`.
    RequestId,
    /// `Authorization`.
    Authorization,
    /// `Content-Type`.
    ContentType,
    /// `Host`.
    Host,
}

/// The names of [`Known`] fields, in its order.
const KNOWN_NAMES: [&[u8]; 8] = [
    b"content-length",
    b"transfer-encoding",
    b"expect",
    b"connection",
    b"x-request-id",
    b"authorization",
    b"content-type",
    b"host",
];

/// Which known field `name` is (any case).
fn known(name: &[u8]) -> Option<usize> {
    KNOWN_NAMES
        .iter()
        .position(|known| known.len() == name.len() && known.eq_ignore_ascii_case(name))
}

/// The fields of one head, over the head's bytes.
#[derive(Debug, Clone, Default)]
pub struct Fields {
    bytes: Bytes,
    fields: Vec<Field>,
    /// Index in `fields` of each [`Known`] field's first occurrence.
    first: [Option<u8>; KNOWN_NAMES.len()],
    /// Bit `k`: [`Known`] field `k` occurs more than once.
    repeated: u8,
}

/// The position of `part` (a slice of the buffer at `base`) in that buffer.
fn span(base: usize, part: &[u8]) -> Range<usize> {
    let start = part.as_ptr() as usize - base;
    start..start + part.len()
}

/// The positions of httparse's fields in the buffer at `base` (whose bytes the caller sets).
fn index(base: usize, parsed: &[httparse::Header<'_>]) -> Fields {
    let mut first = [None; KNOWN_NAMES.len()];
    let mut repeated = 0u8;
    let mut fields = Vec::with_capacity(parsed.len());
    for (position, field) in parsed.iter().enumerate() {
        if let Some(k) = known(field.name.as_bytes()) {
            match first[k] {
                None => first[k] = u8::try_from(position).ok(),
                Some(_) => repeated |= 1 << k,
            }
        }
        fields.push(Field {
            name: span(base, field.name.as_bytes()),
            value: span(base, field.value),
        });
    }
    Fields {
        bytes: Bytes::new(),
        fields,
        first,
        repeated,
    }
}

impl Fields {
    /// Every field as (name, value), in order.
    #[inline]
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.fields.iter().map(|field| {
            (
                &self.bytes[field.name.clone()],
                &self.bytes[field.value.clone()],
            )
        })
    }

    /// The value of the first `field`.
    #[inline]
    pub fn get(&self, field: Known) -> Option<&[u8]> {
        let position = usize::from(self.first[field as usize]?);
        self.fields
            .get(position)
            .map(|field| &self.bytes[field.value.clone()])
    }

    /// Whether `field` occurs more than once.
    #[inline]
    pub fn repeated(&self, field: Known) -> bool {
        self.repeated & (1 << field as u8) != 0
    }

    /// How many fields there are.
    #[inline]
    pub fn len(&self) -> usize {
        self.fields.len()
    }

    /// Whether the head has no fields.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }
}

/// A parsed HTTP/1 request head.
#[derive(Debug, Clone)]
pub struct RequestHead {
    method: Range<usize>,
    target: Range<usize>,
    /// The minor version (`1` for HTTP/1.1).
    pub minor_version: u8,
    /// The header fields.
    pub fields: Fields,
}

impl RequestHead {
    /// The method, as sent.
    #[inline]
    pub fn method(&self) -> &[u8] {
        &self.fields.bytes[self.method.clone()]
    }

    /// The request target, as sent.
    #[inline]
    pub fn target(&self) -> &[u8] {
        &self.fields.bytes[self.target.clone()]
    }

    /// The request target in origin form (path and query), as engines are sent it: the
    /// target as sent, or the path and query of an absolute-form target
    /// (`http://host/v1/models?x` → `/v1/models?x`; `http://host` → `/`).
    #[inline]
    pub fn origin_form(&self) -> &[u8] {
        let target = self.target();
        if target.first() == Some(&b'/') {
            return target;
        }
        match AbsoluteForm::split(target) {
            Some(absolute) if absolute.rest.is_empty() => b"/",
            Some(absolute) if absolute.rest.starts_with(b"/") => absolute.rest,
            _ => target,
        }
    }

    /// The whole head, as received.
    #[inline]
    pub fn raw(&self) -> &Bytes {
        &self.fields.bytes
    }

    /// The path: the target in origin form without its query.
    #[inline]
    pub fn path(&self) -> &str {
        let target = self.origin_form();
        let end = target.iter().position(|&byte| byte == b'?');
        // httparse accepts only visible ASCII in the target.
        std::str::from_utf8(&target[..end.unwrap_or(target.len())]).unwrap_or("")
    }
}

/// An absolute-form request target (RFC 9112 §3.2.2): `scheme://authority` and the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbsoluteForm<'a> {
    /// The scheme, as sent (`http`, `HTTPS`, ...).
    pub scheme: &'a [u8],
    /// The authority: host, optional userinfo and port.
    pub authority: &'a [u8],
    /// The path and query after the authority (empty, or starting with `/` or `?`).
    pub rest: &'a [u8],
}

impl<'a> AbsoluteForm<'a> {
    /// The parts of `target` when it is `scheme://authority...` (a scheme is a letter, then
    /// letters, digits, `+`, `-` or `.`).
    pub fn split(target: &'a [u8]) -> Option<Self> {
        let colon = target.iter().position(|&byte| byte == b':')?;
        let (scheme, after) = target.split_at(colon);
        let first = *scheme.first()?;
        let scheme_chars = scheme
            .iter()
            .all(|&byte| byte.is_ascii_alphanumeric() || matches!(byte, b'+' | b'-' | b'.'));
        if !first.is_ascii_alphabetic() || !scheme_chars {
            return None;
        }
        let hierarchy = after.strip_prefix(b"://")?;
        let end = hierarchy
            .iter()
            .position(|&byte| matches!(byte, b'/' | b'?' | b'#'))
            .unwrap_or(hierarchy.len());
        let (authority, rest) = hierarchy.split_at(end);
        Some(Self {
            scheme,
            authority,
            rest,
        })
    }
}

/// A parsed HTTP/1 response head.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    /// The status code.
    pub status: u16,
    /// The minor version (`0` for HTTP/1.0).
    pub minor_version: u8,
    /// The header fields.
    pub fields: Fields,
}

/// A `Content-Length` value: decimal digits only (optional surrounding blanks).
#[inline]
pub fn parse_decimal(value: &[u8]) -> Option<u64> {
    let digits = value.trim_ascii();
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &digit| {
        digit
            .is_ascii_digit()
            .then(|| n * 10 + u64::from(digit - b'0'))
    })
}

/// What parsing a buffer's start found.
#[derive(Debug)]
pub enum Parsed<T> {
    /// A whole head.
    Complete(T),
    /// Not all of the head has arrived.
    Partial,
    /// Not a valid head, or more fields than a head may have (256 in a request, 64 in a
    /// response).
    Invalid,
}

/// Parses the request head at the start of `buf`; a complete head is split off it.
pub fn parse_request(buf: &mut BytesMut) -> Parsed<RequestHead> {
    match parse_request_with::<MAX_FIELDS>(buf) {
        Err(httparse::Error::TooManyHeaders) => {
            parse_request_with::<MAX_REQUEST_FIELDS>(buf).unwrap_or(Parsed::Invalid)
        }
        parsed => parsed.unwrap_or(Parsed::Invalid),
    }
}

/// [`parse_request`] with room for `N` fields.
fn parse_request_with<const N: usize>(
    buf: &mut BytesMut,
) -> Result<Parsed<RequestHead>, httparse::Error> {
    let base = buf.as_ptr() as usize;
    let mut parsed = [httparse::EMPTY_HEADER; N];
    let mut request = httparse::Request::new(&mut parsed);
    let length = match request.parse(buf)? {
        httparse::Status::Complete(length) => length,
        httparse::Status::Partial => return Ok(Parsed::Partial),
    };
    let (Some(method), Some(target), Some(minor_version)) =
        (request.method, request.path, request.version)
    else {
        return Ok(Parsed::Invalid);
    };
    let method = span(base, method.as_bytes());
    let target = span(base, target.as_bytes());
    let mut fields = index(base, request.headers);
    // Splitting keeps the bytes where they are, so the positions stay valid.
    fields.bytes = buf.split_to(length).freeze();
    Ok(Parsed::Complete(RequestHead {
        method,
        target,
        minor_version,
        fields,
    }))
}

/// Parses the response head at the start of `buf`; a complete head is split off it.
pub fn parse_response(buf: &mut BytesMut) -> Parsed<ResponseHead> {
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
    let mut fields = index(base, response.headers);
    fields.bytes = buf.split_to(length).freeze();
    Parsed::Complete(ResponseHead {
        status,
        minor_version,
        fields,
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
        assert_eq!(head.fields.get(Known::ContentLength), Some(&b"2"[..]));
        assert_eq!(head.fields.len(), 2);
        assert!(head.fields.get(Known::RequestId).is_none());
        assert!(!head.fields.repeated(Known::ContentLength));
    }

    #[test]
    fn absolute_form_targets_have_an_origin_form() {
        let origin = |target: &str| {
            let raw = format!("POST {target} HTTP/1.1\r\nHost: a\r\n\r\n");
            let Parsed::Complete(head) = parse_request(&mut BytesMut::from(raw.as_bytes())) else {
                panic!("not parsed: {raw:?}");
            };
            (
                String::from_utf8(head.origin_form().to_vec()).unwrap(),
                head.path().to_string(),
            )
        };
        let cases = [
            ("/v1/models?x=1", "/v1/models?x=1", "/v1/models"),
            ("http://a:80/v1/models?x=1", "/v1/models?x=1", "/v1/models"),
            ("HTTPS://a", "/", "/"),
            ("*", "*", "*"),
        ];
        for (target, origin_form, path) in cases {
            assert_eq!(
                origin(target),
                (origin_form.to_string(), path.to_string()),
                "{target}"
            );
        }
        let split = AbsoluteForm::split(b"http://u@a:1?q").unwrap();
        assert_eq!(
            (split.scheme, split.authority, split.rest),
            (&b"http"[..], &b"u@a:1"[..], &b"?q"[..])
        );
        for not_absolute in [&b"/a://b"[..], b"1http://a/", b"a:443", b"mailto:x"] {
            assert_eq!(AbsoluteForm::split(not_absolute), None, "{not_absolute:?}");
        }
    }

    #[test]
    fn lengths_are_plain_decimals() {
        assert_eq!(parse_decimal(b" 42 "), Some(42));
        assert_eq!(parse_decimal(b"0"), Some(0));
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b"1a",
            b"0x10",
            b"99999999999999999999",
        ] {
            assert_eq!(parse_decimal(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn repeated_known_fields_are_flagged() {
        let raw = b"POST / HTTP/1.1\r\nContent-Length: 2\r\nx: 1\r\ncontent-length: 3\r\n\r\n";
        let Parsed::Complete(head) = parse_request(&mut BytesMut::from(&raw[..])) else {
            panic!("not parsed");
        };
        assert_eq!(head.fields.get(Known::ContentLength), Some(&b"2"[..]));
        assert!(head.fields.repeated(Known::ContentLength));
        assert!(!head.fields.repeated(Known::Connection));
    }

    #[test]
    fn partial_and_invalid_heads_are_told_apart() {
        let parse = |raw: &[u8]| parse_request(&mut BytesMut::from(raw));
        assert!(matches!(parse(b"POST / HTTP/1.1\r\nHo"), Parsed::Partial));
        assert!(matches!(
            parse(b"POST / HTTP/1.1\r\n\x01: x\r\n\r\n"),
            Parsed::Invalid
        ));
        let fields = |n: usize| {
            let many: String = (0..n).map(|i| format!("x-{i}: 1\r\n")).collect();
            format!("POST / HTTP/1.1\r\n{many}\r\n")
        };
        let Parsed::Complete(head) = parse(fields(MAX_FIELDS + 1).as_bytes()) else {
            panic!("a head over the first parse's room is parsed again");
        };
        assert_eq!(head.fields.len(), MAX_FIELDS + 1);
        assert!(matches!(
            parse(fields(MAX_REQUEST_FIELDS).as_bytes()),
            Parsed::Complete(_)
        ));
        assert!(matches!(
            parse(fields(MAX_REQUEST_FIELDS + 1).as_bytes()),
            Parsed::Invalid
        ));
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
        assert_eq!(head.fields.get(Known::ContentLength), Some(&b"5"[..]));
    }
}

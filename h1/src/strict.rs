//! What kvmesh holds an HTTP/1.1 head to before it reads the body (RFC 9112): one
//! unambiguous way to delimit the body (§6), and for requests one valid `Host` (§3.2) and a
//! request target in one of its forms (§3.2). A head that breaks them is refused, never
//! guessed at: two parsers that guess differently are how requests are smuggled (§11.2).
//!
//! - `Content-Length` and `Transfer-Encoding` together: refused (§6.3 allows an
//!   intermediary to drop the length and go on; kvmesh does not).
//! - `Transfer-Encoding`: exactly `chunked` (any case), in one field; anything else,
//!   `gzip, chunked` included, is a coding kvmesh does not decode. Not on HTTP/1.0 (§6.1).
//! - `Content-Length`: decimal digits; several fields or list members must all be equal
//!   (RFC 9110 §8.6), and then count as one.
//! - `Host`: exactly one on an HTTP/1.1 request (at most one on HTTP/1.0), made of the
//!   characters a URI authority may hold.
//! - The target: origin form (`/path?query`), `*`, or absolute form `http(s)://authority/...`
//!   whose authority is the `Host` (the path is routed and forwarded, the authority not);
//!   nothing else (authority form is only for `CONNECT`, which kvmesh does not serve), and no
//!   fragment (`#...`), which some servers drop and others keep.
//!
//! Chunked bodies are checked as they are decoded ([`crate::body`]); header field syntax
//! (names, values without control characters, no obsolete line folding) by the parser
//! ([`crate::head`]).

use crate::body::{ChunkState, Framing};
use crate::head::{AbsoluteForm, Fields, Known, RequestHead, ResponseHead, parse_decimal};

/// Why a message is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Violation {
    /// Both `Content-Length` and `Transfer-Encoding`.
    LengthAndCoding,
    /// A `Transfer-Encoding` other than exactly `chunked`, or one on an HTTP/1.0 message.
    TransferCoding,
    /// A `Content-Length` that is not a decimal number, or several that differ.
    ContentLength,
    /// An HTTP/1.1 request without `Host`, a request with more than one, or an invalid one.
    Host,
    /// A request target in none of the forms of RFC 9112 §3.2 (one with a `#` fragment
    /// included), or an absolute-form target that is not `http` or `https`, has userinfo, or
    /// whose authority is not the `Host`.
    Target,
    /// A chunk-size line, chunk extension, chunk data end or trailer section that is not
    /// as RFC 9112 §7.1 writes it, or a chunk size over 64 bits.
    Chunk,
}

/// Number of [`Violation`]s.
pub const VIOLATIONS: usize = 6;

impl Violation {
    /// Every violation, in declaration order.
    pub const ALL: [Violation; VIOLATIONS] = [
        Self::LengthAndCoding,
        Self::TransferCoding,
        Self::ContentLength,
        Self::Host,
        Self::Target,
        Self::Chunk,
    ];

    /// A metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::LengthAndCoding => "content_length_and_transfer_encoding",
            Self::TransferCoding => "transfer_encoding",
            Self::ContentLength => "content_length",
            Self::Host => "host",
            Self::Target => "target",
            Self::Chunk => "chunk",
        }
    }

    /// What is wrong, for an error message.
    pub fn describe(self) -> &'static str {
        match self {
            Self::LengthAndCoding => "both Content-Length and Transfer-Encoding are present",
            Self::TransferCoding => "the only Transfer-Encoding accepted is chunked (HTTP/1.1)",
            Self::ContentLength => "Content-Length is not a number, or several values differ",
            Self::Host => "an HTTP/1.1 request needs exactly one valid Host field",
            Self::Target => {
                "the request target must be a path, or an http(s) URL whose authority is the Host"
            }
            Self::Chunk => "the chunked body is malformed (chunk size, extension or trailer)",
        }
    }
}

/// How the body of the request `head` is delimited, or why the head is refused.
pub fn request_framing(head: &RequestHead) -> Result<Framing, Violation> {
    check_host_and_target(head)?;
    Ok(body_framing(head.minor_version, &head.fields)?.unwrap_or(Framing::Length(0)))
}

/// How the body of the response `head` (to a request other than `HEAD`) is delimited, or
/// why the head is refused. `1xx`, `204` and `304` responses have no body whatever their
/// fields say.
pub fn response_framing(head: &ResponseHead) -> Result<Framing, Violation> {
    if matches!(head.status, 100..=199 | 204 | 304) {
        return Ok(Framing::Length(0));
    }
    Ok(body_framing(head.minor_version, &head.fields)?.unwrap_or(Framing::Close))
}

/// The framing the fields declare (`None`: neither a length nor a coding).
fn body_framing(minor_version: u8, fields: &Fields) -> Result<Option<Framing>, Violation> {
    if let Some(lookalike) = lookalike(fields) {
        return Err(lookalike);
    }
    match (
        fields.get(Known::TransferEncoding),
        fields.get(Known::ContentLength),
    ) {
        (Some(_), Some(_)) => Err(Violation::LengthAndCoding),
        (Some(coding), None) => {
            let chunked = minor_version >= 1
                && !fields.repeated(Known::TransferEncoding)
                && coding.trim_ascii().eq_ignore_ascii_case(b"chunked");
            if chunked {
                Ok(Some(Framing::Chunked(ChunkState::Size)))
            } else {
                Err(Violation::TransferCoding)
            }
        }
        (None, Some(length)) if !fields.repeated(Known::ContentLength) => {
            content_length([length]).map(|length| Some(Framing::Length(length)))
        }
        (None, Some(_)) => content_length(
            fields
                .iter()
                .filter(|(name, _)| name.eq_ignore_ascii_case(b"content-length"))
                .map(|(_, value)| value),
        )
        .map(|length| Some(Framing::Length(length))),
        (None, None) => Ok(None),
    }
}

/// A field named like a framing field with `_` for `-` (`Content_Length`,
/// `Transfer_Encoding`): a different field to kvmesh, but the same to servers that map
/// both to one name (CGI and WSGI environments do).
fn lookalike(fields: &Fields) -> Option<Violation> {
    const LOOKALIKES: [(&[u8], Violation); 2] = [
        (b"content-length", Violation::ContentLength),
        (b"transfer-encoding", Violation::TransferCoding),
    ];
    fields.iter().find_map(|(name, _)| {
        if !name.contains(&b'_') {
            return None;
        }
        LOOKALIKES.iter().find_map(|&(framing, violation)| {
            let alike = name.len() == framing.len()
                && name.iter().zip(framing).all(|(&byte, &expected)| {
                    byte.to_ascii_lowercase() == expected || (byte == b'_' && expected == b'-')
                });
            alike.then_some(violation)
        })
    })
}

/// The one length that the `Content-Length` values (each possibly a comma-separated list)
/// all agree on.
fn content_length<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Result<u64, Violation> {
    let mut agreed = None;
    for value in values {
        for member in value.split(|&byte| byte == b',') {
            let length = parse_decimal(member).ok_or(Violation::ContentLength)?;
            if agreed.is_some_and(|agreed| agreed != length) {
                return Err(Violation::ContentLength);
            }
            agreed = Some(length);
        }
    }
    agreed.ok_or(Violation::ContentLength)
}

/// Checks the request's `Host` and target.
fn check_host_and_target(head: &RequestHead) -> Result<(), Violation> {
    let host = head.fields.get(Known::Host);
    if head.fields.repeated(Known::Host)
        || (head.minor_version >= 1 && host.is_none())
        || host.is_some_and(|host| !host.iter().all(|&byte| is_host_byte(byte)))
    {
        return Err(Violation::Host);
    }
    let target = head.target();
    // A fragment is no part of a request target: a server that drops it (hyper) and one that
    // keeps it read two paths (found by h1/tests/hyper_differential.rs).
    if target.contains(&b'#') {
        return Err(Violation::Target);
    }
    if target.starts_with(b"/") || target == b"*" {
        return Ok(());
    }
    let Some(absolute) = AbsoluteForm::split(target) else {
        return Err(Violation::Target);
    };
    let web = absolute.scheme.eq_ignore_ascii_case(b"http")
        || absolute.scheme.eq_ignore_ascii_case(b"https");
    let authority_ok =
        !absolute.authority.is_empty() && absolute.authority.iter().all(|&b| is_host_byte(b));
    let rest_ok = absolute.rest.is_empty() || absolute.rest.starts_with(b"/");
    if web && authority_ok && rest_ok && host.is_none_or(|host| host == absolute.authority) {
        Ok(())
    } else {
        Err(Violation::Target)
    }
}

/// Whether `byte` may appear in a URI authority without userinfo, as `Host` holds it
/// (RFC 3986 §3.2: unreserved, sub-delims, `:`, `[`, `]` and percent-encoding).
fn is_host_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric()
        || matches!(
            byte,
            b'-' | b'.'
                | b'_'
                | b'~'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'['
                | b']'
                | b'%'
        )
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;

    use super::*;
    use crate::head::{Parsed, parse_request, parse_response};

    fn request(raw: &str) -> Result<Framing, Violation> {
        let Parsed::Complete(head) = parse_request(&mut BytesMut::from(raw.as_bytes())) else {
            panic!("not a head: {raw:?}");
        };
        request_framing(&head)
    }

    fn response(raw: &str) -> Result<Framing, Violation> {
        let Parsed::Complete(head) = parse_response(&mut BytesMut::from(raw.as_bytes())) else {
            panic!("not a head: {raw:?}");
        };
        response_framing(&head)
    }

    #[test]
    fn requests_have_one_way_to_end() {
        let ok = [
            ("POST / HTTP/1.1\r\nHost: a\r\n\r\n", Framing::Length(0)),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n",
                Framing::Length(5),
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\n",
                Framing::Length(5),
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\n",
                Framing::Length(5),
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked\r\n\r\n",
                Framing::Chunked(ChunkState::Size),
            ),
            (
                "POST / HTTP/1.0\r\nContent-Length: 1\r\n\r\n",
                Framing::Length(1),
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nx_content_length: 1\r\n\r\n",
                Framing::Length(0),
            ),
        ];
        for (raw, framing) in ok {
            assert_eq!(request(raw), Ok(framing), "{raw:?}");
        }
        let refused = [
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
                Violation::LengthAndCoding,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n",
                Violation::LengthAndCoding,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n",
                Violation::TransferCoding,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
                Violation::TransferCoding,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                Violation::TransferCoding,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
                Violation::TransferCoding,
            ),
            (
                "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
                Violation::TransferCoding,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
                Violation::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 6\r\n\r\n",
                Violation::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\n",
                Violation::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x5\r\n\r\n",
                Violation::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5,\r\n\r\n",
                Violation::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n",
                Violation::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent_Length: 5\r\n\r\n",
                Violation::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\ntransfer_encoding: chunked\r\n\r\n",
                Violation::TransferCoding,
            ),
        ];
        for (raw, violation) in refused {
            assert_eq!(request(raw), Err(violation), "{raw:?}");
        }
    }

    #[test]
    fn requests_name_one_host_and_a_target_in_its_forms() {
        let ok = [
            "GET * HTTP/1.1\r\nHost: a\r\n\r\n",
            "POST /v1/models?x=1 HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n",
            "POST /v1/models HTTP/1.1\r\nHost:\r\n\r\n",
            "POST http://a:80/v1/models HTTP/1.1\r\nHost: a:80\r\n\r\n",
            "POST HTTPS://a HTTP/1.1\r\nHost: a\r\n\r\n",
            "POST http://a/v1 HTTP/1.0\r\n\r\n",
            "POST /v1/models HTTP/1.0\r\n\r\n",
        ];
        for raw in ok {
            assert_eq!(request(raw), Ok(Framing::Length(0)), "{raw:?}");
        }
        let refused = [
            ("POST / HTTP/1.1\r\n\r\n", Violation::Host),
            (
                "POST / HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n",
                Violation::Host,
            ),
            (
                "POST / HTTP/1.0\r\nHost: a\r\nhost: b\r\n\r\n",
                Violation::Host,
            ),
            ("POST / HTTP/1.1\r\nHost: a b\r\n\r\n", Violation::Host),
            ("POST / HTTP/1.1\r\nHost: a/b\r\n\r\n", Violation::Host),
            ("POST / HTTP/1.1\r\nHost: u@a\r\n\r\n", Violation::Host),
            (
                "POST http://b/v1/models HTTP/1.1\r\nHost: a\r\n\r\n",
                Violation::Target,
            ),
            (
                "POST http://u@a/v1/models HTTP/1.1\r\nHost: a\r\n\r\n",
                Violation::Target,
            ),
            (
                "POST ftp://a/v1/models HTTP/1.1\r\nHost: a\r\n\r\n",
                Violation::Target,
            ),
            (
                "POST http://a?x HTTP/1.1\r\nHost: a\r\n\r\n",
                Violation::Target,
            ),
            (
                "POST http:///v1 HTTP/1.1\r\nHost: a\r\n\r\n",
                Violation::Target,
            ),
            (
                "CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n",
                Violation::Target,
            ),
            (
                "POST v1/models HTTP/1.1\r\nHost: a\r\n\r\n",
                Violation::Target,
            ),
            // Found by tests/hyper_differential.rs: hyper reads `/#` as `/`.
            ("POST /# HTTP/1.1\r\nHost: a\r\n\r\n", Violation::Target),
            (
                "POST /v1/models#x?y HTTP/1.1\r\nHost: a\r\n\r\n",
                Violation::Target,
            ),
            (
                "POST http://a/v1#x HTTP/1.1\r\nHost: a\r\n\r\n",
                Violation::Target,
            ),
        ];
        for (raw, violation) in refused {
            assert_eq!(request(raw), Err(violation), "{raw:?}");
        }
    }

    #[test]
    fn responses_have_one_way_to_end() {
        assert_eq!(response("HTTP/1.1 200 OK\r\n\r\n"), Ok(Framing::Close));
        assert_eq!(
            response(
                "HTTP/1.1 204 No Content\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
            ),
            Ok(Framing::Length(0))
        );
        assert_eq!(
            response("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n"),
            Ok(Framing::Length(2))
        );
        assert_eq!(
            response("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"),
            Ok(Framing::Chunked(ChunkState::Size))
        );
        for (raw, violation) in [
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
                Violation::LengthAndCoding,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
                Violation::ContentLength,
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: two\r\n\r\n",
                Violation::ContentLength,
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
                Violation::TransferCoding,
            ),
            (
                "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                Violation::TransferCoding,
            ),
        ] {
            assert_eq!(response(raw), Err(violation), "{raw:?}");
        }
    }

    #[test]
    fn violations_have_distinct_labels() {
        let mut labels: Vec<_> = Violation::ALL.iter().map(|v| v.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), VIOLATIONS);
    }
}

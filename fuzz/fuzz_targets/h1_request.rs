//! The HTTP/1.1 request parser with its framing and body, read as the proxy's fast path reads
//! a client connection (`proxy/src/frontend/h1/server.rs`): the head (`parse_request`), its
//! framing (`request_framing`: RFC 9112's rules against smuggling), the body (`Framing::decode`).
//!
//! Whatever the bytes: nothing panics; the bytes read the same however they arrive (whole, in
//! two pieces, in three); and a request that is accepted, forwarded as the proxy forwards it
//! (origin form, end-to-end fields, its own `Host` and the body's length), reads back as
//! exactly itself with nothing left over.

#![no_main]

use bytes::BytesMut;
use kvmesh_h1::body::{Decoded, Framing};
use kvmesh_h1::fields::{is_100_continue, is_end_to_end, is_event_stream_type};
use kvmesh_h1::head::{AbsoluteForm, Known, Parsed, RequestHead, parse_request};
use kvmesh_h1::strict::request_framing;
use libfuzzer_sys::fuzz_target;

/// What a server makes of the first request in some bytes.
#[derive(Debug, PartialEq, Eq)]
enum Read {
    /// Not HTTP, against `kvmesh_h1::strict`, or badly framed.
    Refused,
    /// Not all of it arrived.
    Incomplete,
    /// A request: what is forwarded of it, its path, and the bytes after it.
    Request {
        forwarded: Vec<u8>,
        path: String,
        rest: Vec<u8>,
    },
}

/// Reads the first request out of `parts`, arriving one after the other.
fn read(parts: &[&[u8]]) -> Read {
    let mut parts = parts.iter();
    let mut buf = BytesMut::new();
    let head = loop {
        match parse_request(&mut buf) {
            Parsed::Complete(head) => break head,
            Parsed::Invalid => return Read::Refused,
            Parsed::Partial => match parts.next() {
                Some(part) => buf.extend_from_slice(part),
                None => return Read::Incomplete,
            },
        }
    };
    let Ok(mut framing) = request_framing(&head) else {
        return Read::Refused;
    };
    let mut body = Vec::new();
    loop {
        let length = match framing {
            Framing::Length(length) => Some(length),
            _ => None,
        };
        match framing.decode(&mut buf, false) {
            Err(_) => return Read::Refused,
            Ok(Decoded::Data(data)) => {
                assert!(!data.is_empty(), "a data piece is never empty");
                assert!(length.is_none_or(|length| data.len() as u64 <= length));
                body.extend_from_slice(&data);
            }
            Ok(Decoded::End) => break,
            Ok(Decoded::NeedMore) => match parts.next() {
                Some(part) => buf.extend_from_slice(part),
                None => return Read::Incomplete,
            },
        }
    }
    assert!(framing.is_done());
    look_at_fields(&head);
    let mut rest = buf.to_vec();
    parts.for_each(|part| rest.extend_from_slice(part));
    Read::Request {
        forwarded: forwarded(&head, &body),
        path: head.path().to_owned(),
        rest,
    }
}

/// What the proxy asks of an accepted head's fields.
fn look_at_fields(head: &RequestHead) {
    for field in [
        Known::ContentLength,
        Known::TransferEncoding,
        Known::Expect,
        Known::Connection,
        Known::RequestId,
        Known::Authorization,
        Known::ContentType,
        Known::Host,
    ] {
        let first = head.fields.get(field);
        assert!(first.is_some() || !head.fields.repeated(field));
    }
    if let Some(expect) = head.fields.get(Known::Expect) {
        is_100_continue(expect);
    }
    if let Some(content_type) = head.fields.get(Known::ContentType) {
        is_event_stream_type(content_type);
    }
    if let Some(absolute) = AbsoluteForm::split(head.target()) {
        assert!(absolute.rest.is_empty() || matches!(absolute.rest[0], b'/' | b'?' | b'#'));
    }
    let origin = head.origin_form();
    assert!(origin.starts_with(b"/") || origin == b"*", "{origin:?}");
}

/// The request as the proxy forwards it to an engine.
fn forwarded(head: &RequestHead, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(head.method());
    out.push(b' ');
    out.extend_from_slice(head.origin_form());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let connection = head.fields.get(Known::Connection);
    for (name, value) in head.fields.iter() {
        let ours =
            name.eq_ignore_ascii_case(b"host") || name.eq_ignore_ascii_case(b"content-length");
        if !ours && is_end_to_end(name, connection) {
            out.extend_from_slice(name);
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
    }
    out.extend_from_slice(
        format!("host: engine\r\ncontent-length: {}\r\n\r\n", body.len()).as_bytes(),
    );
    out.extend_from_slice(body);
    out
}

/// A cut point in `0..=len` that follows the bytes (so that the fuzzer moves it by mutating
/// them).
fn cut(data: &[u8], salt: u64) -> usize {
    let hash = data
        .iter()
        .fold(salt ^ 0xcbf2_9ce4_8422_2325, |hash, &byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
    (hash % (data.len() as u64 + 1)) as usize
}

fuzz_target!(|data: &[u8]| {
    let whole = read(&[data]);
    let one = cut(data, 1);
    assert_eq!(whole, read(&[&data[..one], &data[one..]]), "cut at {one}");
    let (a, b) = {
        let (x, y) = (cut(data, 2), cut(data, 3));
        (x.min(y), x.max(y))
    };
    assert_eq!(
        whole,
        read(&[&data[..a], &data[a..b], &data[b..]]),
        "cut at {a} and {b}"
    );
    if let Read::Request {
        forwarded, path, ..
    } = whole
    {
        let again = read(&[&forwarded]);
        assert_eq!(
            again,
            Read::Request {
                forwarded: forwarded.clone(),
                path,
                rest: Vec::new()
            },
            "the forwarded request reads as itself"
        );
    }
});

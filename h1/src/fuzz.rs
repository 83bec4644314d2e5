//! Fuzz-style tests (proptest) of the codec: whatever bytes arrive as a head or as a
//! chunked body, nothing panics, and a body decodes the same however it is split; and a
//! request smuggling corpus (CL.TE, TE.CL, TE.TE obfuscations, bad chunk lines, bad line
//! ends, NUL and control bytes, Host and target tricks): every request is either refused or
//! read one way only, the way it is forwarded (framed by its length, in origin form), so
//! that the request an engine reads is the request the proxy read.

use bytes::BytesMut;
use proptest::prelude::*;

use crate::body::{ChunkState, Decoded, Framing};
use crate::fields::is_end_to_end;
use crate::head::{Known, Parsed, RequestHead, parse_request, parse_response};
use crate::strict::request_framing;

/// Decodes `parts` in turn with `framing`; the body so far and whether it ended, or `None`
/// on a framing error.
fn decode(framing: &mut Framing, parts: &[&[u8]]) -> Option<(Vec<u8>, bool)> {
    let mut buf = BytesMut::new();
    let mut body = Vec::new();
    for part in parts {
        buf.extend_from_slice(part);
        loop {
            match framing.decode(&mut buf, false).ok()? {
                Decoded::Data(data) => body.extend_from_slice(&data),
                Decoded::NeedMore => break,
                Decoded::End => return Some((body, true)),
            }
        }
    }
    Some((body, false))
}

/// What a server makes of the first request in some bytes.
#[derive(Debug, PartialEq, Eq)]
enum Read {
    /// Refused: the head is not HTTP, breaks [`crate::strict`], or the body's framing is bad.
    Refused,
    /// Not all of it arrived.
    Incomplete,
    /// A request: what is forwarded of it, and the bytes after it.
    Request { forwarded: Vec<u8>, rest: Vec<u8> },
}

/// Reads the first request out of `parts` (arriving one after the other) as the proxy
/// does: the head, its framing, the body.
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
        match framing.decode(&mut buf, false) {
            Err(_) => return Read::Refused,
            Ok(Decoded::Data(data)) => body.extend_from_slice(&data),
            Ok(Decoded::End) => break,
            Ok(Decoded::NeedMore) => match parts.next() {
                Some(part) => buf.extend_from_slice(part),
                None => return Read::Incomplete,
            },
        }
    }
    let mut rest = buf.to_vec();
    parts.for_each(|part| rest.extend_from_slice(part));
    Read::Request {
        forwarded: forwarded(&head, &body),
        rest,
    }
}

/// The request as a proxy forwards it: origin form, the end-to-end fields but `Host` and
/// `Content-Length`, its own `Host` and the body's length.
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

/// What `raw` is read as, checked: however the bytes are split, the same; and an accepted
/// request, forwarded, is read back as exactly itself.
fn read_checked(raw: &[u8], cut: usize) -> Read {
    let whole = read(&[raw]);
    let split = read(&[&raw[..cut], &raw[cut..]]);
    assert_eq!(
        whole,
        split,
        "split at {cut}: {:?}",
        String::from_utf8_lossy(raw)
    );
    if let Read::Request { forwarded, .. } = &whole {
        let again = read(&[forwarded]);
        assert_eq!(
            again,
            Read::Request {
                forwarded: forwarded.clone(),
                rest: Vec::new()
            },
            "the forwarded request reads as itself: {:?}",
            String::from_utf8_lossy(forwarded)
        );
    }
    whole
}

/// A request that an engine must never see, appended to every corpus entry.
const SMUGGLED: &str = "GET /admin HTTP/1.1\r\nHost: a\r\n\r\n";

/// Requests that are refused, whatever follows them.
const REFUSED: &[&str] = &[
    // CL.TE and TE.CL.
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nX",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n5c\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 44\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0, 44\r\n\r\n",
    // TE.TE: a coding one parser reads as chunked and another does not.
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding\t: chunked\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity, chunked\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \"chunked\"\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\x00\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\x0bchunked\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\n Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nX: y\r\n Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nX: y\r\n\tContent-Length: 5\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer_Encoding: chunked\r\n\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nContent_Length: 5\r\n\r\nhello",
    "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    // Lengths that are not plain decimals.
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nhello",
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x5\r\n\r\nhello",
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5 5\r\n\r\nhello",
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\x00\r\n\r\nhello",
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 18446744073709551616\r\n\r\n",
    // Bad chunk lines, extensions and ends.
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n\r\nhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\nhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;\x00\r\nhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;a\nb\r\nhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;a=\"b\r\nhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\n0\n\n",
    "POST / HTTP/1.1\nHost: a\nTransfer-Encoding: chunked\n\n5\nhello\n0\n\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\rhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n10000000000000001\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx folded\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n t: v\r\n\r\n",
    // Control bytes and bare CR in the head.
    "POST / HTTP/1.1\r\nHost: a\r\nX: a\x01b\r\nContent-Length: 0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nX: a\x7fb\r\nContent-Length: 0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nX: a\rContent-Length: 5\r\n\r\nhello",
    "POST / HTTP/1.1\r\nHost: a\r\n\x00: x\r\n\r\n",
    "POST /\x00 HTTP/1.1\r\nHost: a\r\n\r\n",
    // Host and target.
    "POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nHost: b\r\nContent-Length: 0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a@b\r\nContent-Length: 0\r\n\r\n",
    "POST http://b/v1/models HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
    "POST http://a@b/v1/models HTTP/1.1\r\nHost: b\r\nContent-Length: 0\r\n\r\n",
    "POST file://a/v1/models HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
    "POST a:80 HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
];

/// Unusual requests that are read, with the target and body they are forwarded with.
const ACCEPTED: &[(&str, &str, &str)] = &[
    (
        "POST /v1 HTTP/1.1\nHost: a\nContent-Length: 5\n\nhello",
        "/v1",
        "hello",
    ),
    (
        "POST /v1 HTTP/1.1\r\nHost: a\r\nContent-Length:\t5 \r\n\r\nhello",
        "/v1",
        "hello",
    ),
    (
        "POST /v1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\ncontent-length: 5, 5\r\n\r\nhello",
        "/v1",
        "hello",
    ),
    (
        "POST /v1 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: CHUNKED\r\n\r\n005;a=b;c=\"d;e\\\"\"\r\nhello\r\n0\r\nx-t: 1\r\n\r\n",
        "/v1",
        "hello",
    ),
    (
        "POST http://a:8080/v1?q=1 HTTP/1.1\r\nHost: a:8080\r\nContent-Length: 2\r\n\r\nhi",
        "/v1?q=1",
        "hi",
    ),
    (
        "POST http://a HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
        "/",
        "",
    ),
];

#[test]
fn the_smuggling_corpus_is_refused() {
    for request in REFUSED {
        let raw = format!("{request}{SMUGGLED}");
        for cut in 0..=raw.len() {
            assert_eq!(
                read_checked(raw.as_bytes(), cut),
                Read::Refused,
                "{request:?}"
            );
        }
    }
}

#[test]
fn unusual_requests_are_read_one_way_and_forwarded_that_way() {
    for (request, target, body) in ACCEPTED {
        let raw = format!("{request}{SMUGGLED}");
        let Read::Request { forwarded, rest } = read_checked(raw.as_bytes(), request.len() / 2)
        else {
            panic!("refused: {request:?}");
        };
        assert_eq!(rest, SMUGGLED.as_bytes(), "{request:?}");
        let forwarded = String::from_utf8(forwarded).unwrap();
        assert!(
            forwarded.starts_with(&format!("POST {target} HTTP/1.1\r\n")),
            "{forwarded}"
        );
        assert!(
            forwarded.ends_with(&format!("content-length: {}\r\n\r\n{body}", body.len())),
            "{forwarded}"
        );
        assert!(!forwarded.to_ascii_lowercase().contains("transfer-encoding"));
    }
}

/// A field line a request may carry, some of them smuggling tricks; `n` is the body's
/// length.
fn field_line(choice: u8, n: usize) -> String {
    match choice % 16 {
        0 => "Host: a".into(),
        1 => "Host: b".into(),
        2 => format!("Content-Length: {n}"),
        3 => format!("Content-Length: {}", n + 1),
        4 => format!("Content-Length: +{n}"),
        5 => format!("Content-Length: {n}, {n}"),
        6 => "Transfer-Encoding: chunked".into(),
        7 => "Transfer-Encoding: xchunked".into(),
        8 => "Transfer-Encoding : chunked".into(),
        9 => "Transfer-Encoding: chunked, identity".into(),
        10 => "Transfer-Encoding:\tchunked".into(),
        11 => "Transfer_Encoding: chunked".into(),
        12 => " Transfer-Encoding: chunked".into(),
        13 => "Transfer-Encoding: chunked\0".into(),
        14 => "Connection: close".into(),
        _ => "X-Other: y".into(),
    }
}

/// A chunk-size line for `size`, possibly obfuscated.
fn size_line(choice: u8, size: usize) -> String {
    match choice % 10 {
        0..=2 => format!("{size:x}"),
        3 => format!("0{size:X}"),
        4 => format!("+{size:x}"),
        5 => format!("0x{size:x}"),
        6 => format!("{size:x} "),
        7 => format!("{size:x};a=b"),
        8 => format!("{size:x};a=\"q\\\"\""),
        _ => format!("{size:x};\0"),
    }
}

/// A line end, possibly not CRLF.
fn line_end(choice: u8) -> &'static str {
    match choice % 8 {
        0 => "\n",
        1 => "",
        2 => "\r",
        _ => "\r\n",
    }
}

prop_compose! {
    /// A request built from field lines, chunks and line ends that are mostly right and
    /// sometimes one of the smuggling tricks, followed by [`SMUGGLED`].
    fn tricky_request()(
        target in prop::sample::select(vec!["/v1/chat/completions", "http://a/v1/x", "http://b/v1/x", "*", "v1/x"]),
        minor in 0u8..2,
        fields in prop::collection::vec((any::<u8>(), any::<u8>()), 0..6),
        chunks in prop::collection::vec((any::<u8>(), any::<u8>(), prop::collection::vec(any::<u8>(), 1..24)), 0..4),
        trailer in any::<bool>(),
        host in any::<bool>(),
        head_end in any::<u8>(),
    ) -> Vec<u8> {
        let length: usize = chunks.iter().map(|(_, _, data)| data.len()).sum();
        let mut raw = format!("POST {target} HTTP/1.{minor}\r\n");
        if host {
            raw.push_str("Host: a\r\n");
        }
        for (choice, end) in &fields {
            raw.push_str(&field_line(*choice, length));
            raw.push_str(line_end(*end));
        }
        raw.push_str(line_end(head_end));
        let chunked = fields.iter().any(|(choice, _)| (6..=13).contains(&(choice % 16)));
        let mut raw = raw.into_bytes();
        for (size, end, data) in &chunks {
            if chunked {
                raw.extend_from_slice(size_line(*size, data.len()).as_bytes());
                raw.extend_from_slice(line_end(*end).as_bytes());
            }
            raw.extend_from_slice(data);
            if chunked {
                raw.extend_from_slice(line_end(*end).as_bytes());
            }
        }
        if chunked {
            raw.extend_from_slice(b"0\r\n");
            if trailer {
                raw.extend_from_slice(b"x-t: 1\r\n");
            }
            raw.extend_from_slice(b"\r\n");
        }
        raw.extend_from_slice(SMUGGLED.as_bytes());
        raw
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_bytes_as_a_head_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_request(&mut BytesMut::from(&bytes[..]));
        let _ = parse_response(&mut BytesMut::from(&bytes[..]));
        let mut request = b"POST / HTTP/1.1\r\n".to_vec();
        request.extend_from_slice(&bytes);
        let _ = read(&[&request]);
    }

    #[test]
    fn any_bytes_as_a_chunked_body_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut framing = Framing::Chunked(ChunkState::Size);
        let _ = decode(&mut framing, &[&bytes]);
        let _ = framing.decode(&mut BytesMut::new(), true);
    }

    #[test]
    fn chunked_bodies_decode_the_same_however_split(
        chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 1..64), 0..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut encoded = Vec::new();
        for chunk in &chunks {
            encoded.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
            encoded.extend_from_slice(chunk);
            encoded.extend_from_slice(b"\r\n");
        }
        encoded.extend_from_slice(b"0\r\n\r\n");
        let cut = cut.index(encoded.len());
        let whole = decode(&mut Framing::Chunked(ChunkState::Size), &[&encoded]);
        let split = decode(&mut Framing::Chunked(ChunkState::Size), &[&encoded[..cut], &encoded[cut..]]);
        let expected: Vec<u8> = chunks.concat();
        prop_assert_eq!(whole, Some((expected.clone(), true)));
        prop_assert_eq!(split, Some((expected, true)));
    }

    #[test]
    fn tricky_requests_are_refused_or_read_one_way(
        raw in tricky_request(),
        cut in any::<prop::sample::Index>(),
    ) {
        // `read_checked` asserts that the split does not matter and that what is forwarded
        // reads back as itself.
        let read = read_checked(&raw, cut.index(raw.len() + 1));
        if let Read::Request { forwarded, .. } = read {
            // No forwarded field is named like a transfer coding; the words inside a field's
            // value (`X-Other: yTransfer-Encoding: chunked`, one field) are only text.
            let lower = String::from_utf8_lossy(&forwarded).to_ascii_lowercase();
            let head = lower.split("\r\n\r\n").next().unwrap_or_default();
            for line in head.split("\r\n").skip(1) {
                let name = line.split(':').next().unwrap_or_default();
                prop_assert!(!name.contains("transfer-encoding"), "{}", lower);
                prop_assert!(!name.contains("transfer_encoding"), "{}", lower);
            }
        }
    }
}

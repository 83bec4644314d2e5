//! The HTTP/1.1 response parser with its framing and body, read as the engine client reads an
//! engine's answer (`kvmesh_h1::client`): the head (`parse_response`, `1xx` interim heads
//! skipped), its framing (`response_framing`), the body (`Framing::decode`, with the end of
//! the connection after the last byte).
//!
//! Whatever the bytes: nothing panics, and they read the same however they arrive.

#![no_main]

use bytes::BytesMut;
use kvmesh_h1::body::{Decoded, Framing};
use kvmesh_h1::head::{Parsed, parse_response};
use kvmesh_h1::strict::response_framing;
use libfuzzer_sys::fuzz_target;

/// What the client makes of an engine's answer.
#[derive(Debug, PartialEq, Eq)]
enum Read {
    /// An invalid head, refused framing, or a body that breaks its framing or ends early.
    Broken,
    /// The head did not all arrive.
    Incomplete,
    /// A response: its status, body and the bytes after it (a length-framed body on a
    /// connection the engine keeps open).
    Response {
        status: u16,
        body: Vec<u8>,
        rest: Vec<u8>,
    },
}

fn read(parts: &[&[u8]]) -> Read {
    let mut parts = parts.iter();
    let mut buf = BytesMut::new();
    let mut eof = false;
    let head = loop {
        match parse_response(&mut buf) {
            Parsed::Complete(head) if (100..200).contains(&head.status) => continue,
            Parsed::Complete(head) => break head,
            Parsed::Invalid => return Read::Broken,
            Parsed::Partial => match parts.next() {
                Some(part) => buf.extend_from_slice(part),
                None => return Read::Incomplete,
            },
        }
    };
    let Ok(mut framing) = response_framing(&head) else {
        return Read::Broken;
    };
    let mut body = Vec::new();
    loop {
        let length = match framing {
            Framing::Length(length) => Some(length),
            _ => None,
        };
        match framing.decode(&mut buf, eof) {
            Err(_) => return Read::Broken,
            Ok(Decoded::Data(data)) => {
                assert!(!data.is_empty(), "a data piece is never empty");
                assert!(length.is_none_or(|length| data.len() as u64 <= length));
                body.extend_from_slice(&data);
            }
            Ok(Decoded::End) => break,
            Ok(Decoded::NeedMore) => {
                assert!(!eof, "more wanted after the end of the connection");
                match parts.next() {
                    Some(part) => buf.extend_from_slice(part),
                    None => eof = true,
                }
            }
        }
    }
    let close = framing == Framing::Close;
    assert!(close || framing.is_done());
    let mut rest = buf.to_vec();
    parts.for_each(|part| rest.extend_from_slice(part));
    assert!(
        !close || rest.is_empty(),
        "a close-delimited body takes everything"
    );
    Read::Response {
        status: head.status,
        body,
        rest,
    }
}

/// A cut point in `0..=len` that follows the bytes.
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
    let (x, y) = (cut(data, 2), cut(data, 3));
    let (a, b) = (x.min(y), x.max(y));
    assert_eq!(
        whole,
        read(&[&data[..a], &data[a..b], &data[b..]]),
        "cut at {a} and {b}"
    );
});

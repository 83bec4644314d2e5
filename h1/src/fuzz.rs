//! Fuzz-style tests (proptest) of the codec: whatever bytes arrive as a head or
//! as a chunked body, nothing panics, and a body decodes the same however it is split.

use bytes::BytesMut;
use proptest::prelude::*;

use crate::body::{ChunkState, Decoded, Framing};
use crate::head::{parse_request, parse_response};

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

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_bytes_as_a_head_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_request(&mut BytesMut::from(&bytes[..]));
        let _ = parse_response(&mut BytesMut::from(&bytes[..]));
        let mut request = b"POST / HTTP/1.1\r\n".to_vec();
        request.extend_from_slice(&bytes);
        let _ = parse_request(&mut BytesMut::from(&request[..]));
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
}

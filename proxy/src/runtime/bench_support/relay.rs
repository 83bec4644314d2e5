//! The relay's work per piece of a streamed response, without a network: decoding the
//! engine's chunked framing out of the connection buffer, then scanning the data for SSE
//! events (`benches/relay.rs`). Not a stable API.

use bytes::BytesMut;
use kvmesh_h1::body::{ChunkState, Decoded, Framing};
use kvmesh_wire::sse::SseScanner;

/// Relays one chunked SSE body as the engine sent it (`wire`), read from the connection
/// `read` bytes at a time; returns the data events seen and the data bytes decoded.
pub fn relay_body(wire: &[u8], read: usize) -> (usize, usize) {
    let mut framing = Framing::Chunked(ChunkState::Size);
    let mut scanner = SseScanner::default();
    let mut buf = BytesMut::with_capacity(16 * 1024);
    let (mut events, mut bytes) = (0, 0);
    for piece in wire.chunks(read.max(1)) {
        buf.extend_from_slice(piece);
        while let Ok(Decoded::Data(data)) = framing.decode(&mut buf, false) {
            events += scanner.feed(&data).data_events;
            bytes += data.len();
        }
    }
    (events, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relays_every_event_however_it_is_read() {
        let wire = b"7\r\ndata: a\r\n2\r\n\n\n\r\nc\r\ndata: [DONE]\r\n2\r\n\n\n\r\n0\r\n\r\n";
        for read in [1, 3, 5, wire.len()] {
            assert_eq!(relay_body(wire, read), (1, 23), "reads of {read}");
        }
    }
}

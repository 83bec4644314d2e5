//! A replay request to the engine's ROUTER socket over a DEALER (wire-formats.md §1.4): send
//! `[empty, start_seq u64 BE]`, read `[empty, topic, seq, payload]` (a running vLLM 0.32.0;
//! the topic is empty on the end marker) or `[empty, seq, payload]` until the `-1` end
//! marker.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Deadline of the connect and of each reply message.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(3);
/// The end marker's sequence number (−1 as 8 bytes).
const END: [u8; 8] = [0xFF; 8];

/// Asks `endpoint` for the batches numbered `from` and later; returns them in order.
pub(crate) async fn fetch(endpoint: &str, from: u64) -> Result<Vec<(u64, Bytes)>, String> {
    let mut socket = DealerSocket::new();
    tokio::time::timeout(REPLAY_TIMEOUT, socket.connect(endpoint))
        .await
        .map_err(|_| format!("connecting to {endpoint} timed out"))?
        .map_err(|e| format!("connecting to {endpoint}: {e}"))?;
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
    socket
        .send(request)
        .await
        .map_err(|e| format!("sending the replay request: {e}"))?;
    let mut batches = Vec::new();
    loop {
        let reply = tokio::time::timeout(REPLAY_TIMEOUT, socket.recv())
            .await
            .map_err(|_| "replay reply timed out".to_owned())?
            .map_err(|e| format!("receiving a replay reply: {e}"))?
            .into_vec();
        let [seq, payload] = reply_frames(&reply) else {
            return Err(format!("replay reply with {} frames", reply.len()));
        };
        let seq: [u8; 8] = seq
            .as_ref()
            .try_into()
            .map_err(|_| "replay sequence number is not 8 bytes".to_owned())?;
        if seq == END {
            return Ok(batches);
        }
        batches.push((u64::from_be_bytes(seq), payload.clone()));
    }
}

/// A reply's sequence number and payload frames: after the DEALER's empty delimiter (tolerated
/// when missing) and vLLM's topic frame, when there is one.
fn reply_frames(reply: &[Bytes]) -> &[Bytes] {
    let rest = match reply {
        [delimiter, rest @ ..] if delimiter.is_empty() && (2..=3).contains(&rest.len()) => rest,
        other => other,
    };
    match rest {
        [_topic, seq_and_payload @ ..] if seq_and_payload.len() == 2 => seq_and_payload,
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&'static [u8]]) -> Vec<Bytes> {
        parts.iter().map(|part| Bytes::from_static(part)).collect()
    }

    #[test]
    fn replies_with_and_without_a_topic_frame_are_read() {
        let seq = &[0, 0, 0, 0, 0, 0, 0, 7][..];
        for reply in [
            // vLLM 0.32.0, as a running engine sent it.
            frames(&[b"", b"kv-events", seq, b"batch"]),
            frames(&[b"", seq, b"batch"]),
            frames(&[seq, b"batch"]),
        ] {
            assert_eq!(reply_frames(&reply), &frames(&[seq, b"batch"])[..]);
        }
        let end = frames(&[b"", b"", &END, b""]);
        assert_eq!(reply_frames(&end), &frames(&[&END, b""])[..]);
    }
}

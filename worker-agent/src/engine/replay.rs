//! A replay request to the engine's ROUTER socket over a DEALER (wire-formats.md §1.4): send
//! `[empty, start_seq u64 BE]`, read `[empty, seq, payload]` until the `-1` end marker.

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
        // A DEALER sees [empty, seq, payload]; tolerate a missing delimiter.
        let frames = match reply.as_slice() {
            [delimiter, rest @ ..] if delimiter.is_empty() && rest.len() == 2 => rest,
            other => other,
        };
        let [seq, payload] = frames else {
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

//! The replay ROUTER socket: the last `buffer_steps` batches, served on request.
//!
//! Request as the ROUTER sees it: `[identity, empty, start_seq u64 BE]` (other shapes are
//! ignored). Reply: `[identity, empty, topic, seq BE, payload]` for each buffered batch with
//! `seq >= start_seq`, then the end marker `[identity, empty, empty, 0xFF x 8 (-1), empty]`:
//! the shape a running vLLM 0.32.0 sends (its `ZmqEventPublisher._service_replay`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use zeromq::{RouterSocket, SocketRecv, SocketSend, ZmqMessage};

/// Sequence number of the end-of-replay marker: −1 as a signed 64-bit big-endian integer.
const END_SEQ: [u8; 8] = [0xFF; 8];

/// The most recent encoded batches with their sequence numbers, oldest first.
#[derive(Debug)]
pub(crate) struct ReplayBuffer {
    capacity: usize,
    batches: Mutex<VecDeque<(u64, Bytes)>>,
}

impl ReplayBuffer {
    /// An empty buffer keeping at most `capacity` batches.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            batches: Mutex::new(VecDeque::with_capacity(capacity.min(1024))),
        }
    }

    /// Keeps batch `seq`, forgetting the oldest one when full.
    pub(crate) fn push(&self, seq: u64, payload: Bytes) {
        let mut batches = self.batches.lock().unwrap_or_else(PoisonError::into_inner);
        if batches.len() == self.capacity {
            batches.pop_front();
        }
        batches.push_back((seq, payload));
    }

    /// Forgets every batch (the sequence starts over).
    pub(crate) fn clear(&self) {
        self.batches
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// The buffered batches numbered `start` or later, oldest first.
    pub(crate) fn since(&self, start: u64) -> Vec<(u64, Bytes)> {
        let batches = self.batches.lock().unwrap_or_else(PoisonError::into_inner);
        batches
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect()
    }
}

fn reply(identity: &Bytes, topic: Bytes, seq: Bytes, payload: Bytes) -> ZmqMessage {
    let mut msg = ZmqMessage::from(identity.clone());
    msg.push_back(Bytes::new());
    msg.push_back(topic);
    msg.push_back(seq);
    msg.push_back(payload);
    msg
}

/// Answers replay requests until the socket fails; batches carry `topic`.
pub(crate) async fn serve(mut socket: RouterSocket, buffer: Arc<ReplayBuffer>, topic: Bytes) {
    loop {
        let request = match socket.recv().await {
            Ok(request) => request.into_vec(),
            Err(e) => {
                tracing::warn!(error = %e, "KV event replay socket stopped");
                return;
            }
        };
        let [identity, delimiter, start] = request.as_slice() else {
            tracing::debug!(
                frames = request.len(),
                "ignoring a replay request without 3 frames"
            );
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::debug!("ignoring a replay request whose start is not 8 bytes");
            continue;
        };
        if !delimiter.is_empty() {
            tracing::debug!("ignoring a replay request without an empty delimiter frame");
            continue;
        }
        let start = u64::from_be_bytes(start);
        let batches = buffer.since(start);
        tracing::debug!(start, batches = batches.len(), "replaying KV events");
        let replies = batches
            .into_iter()
            .map(|(seq, payload)| {
                reply(
                    identity,
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                )
            })
            .chain(std::iter::once(reply(
                identity,
                Bytes::new(),
                Bytes::from_static(&END_SEQ),
                Bytes::new(),
            )));
        for msg in replies {
            if let Err(e) = socket.send(msg).await {
                tracing::debug!(error = %e, "replay client went away");
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_latest_batches() {
        let b = ReplayBuffer::new(2);
        for seq in 0..3 {
            b.push(seq, Bytes::from(vec![seq as u8]));
        }
        let seqs: Vec<u64> = b.since(0).into_iter().map(|(s, _)| s).collect();
        assert_eq!(seqs, vec![1, 2]);
        assert_eq!(b.since(2).len(), 1);
        assert!(b.since(3).is_empty());
        b.clear();
        assert!(b.since(0).is_empty());
    }
}

//! Resync by NATS request-reply (docs/control-plane.md, "NATS: resync").

use serde::{Deserialize, Serialize};

use crate::events::{EventBatch, RankedEvent};

/// A request on an instance's snapshot subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SnapshotRequest {
    /// Replay batches from this `seq` on; `None` (`{}`) asks for a full snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_seq: Option<u64>,
}

impl SnapshotRequest {
    /// A request for the whole cache.
    pub fn full() -> Self {
        Self { from_seq: None }
    }

    /// A request for the batches numbered `from_seq` and later.
    pub fn from_seq(from_seq: u64) -> Self {
        Self {
            from_seq: Some(from_seq),
        }
    }

    /// The request as its JSON payload.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a JSON payload.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// The answer to a [`SnapshotRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SnapshotReply {
    /// The batches `from_seq..=last_seq`, from the agent's ring buffer (empty when the receiver
    /// is up to date).
    Events {
        /// The batches, in order.
        batches: Vec<EventBatch>,
        /// The newest batch number the agent has published.
        last_seq: u64,
    },
    /// The instance's whole cache as Stored events (parents first), valid as of `last_seq`.
    /// The receiver drops every block it holds for the instance, then applies the events.
    Snapshot {
        /// Stored events per data-parallel rank.
        events: Vec<RankedEvent>,
        /// The batch number the snapshot is valid at; continue with `last_seq + 1`.
        last_seq: u64,
    },
}

impl SnapshotReply {
    /// The newest batch number the reply accounts for.
    pub fn last_seq(&self) -> u64 {
        match self {
            Self::Events { last_seq, .. } | Self::Snapshot { last_seq, .. } => *last_seq,
        }
    }

    /// The reply as its JSON payload.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a JSON payload.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_kv::{ExternalHash, KvEvent, LocalBlockHash};

    use super::*;
    use crate::ids::InstanceId;

    #[test]
    fn requests_match_the_contract() {
        assert_eq!(SnapshotRequest::full().to_json(), b"{}");
        assert_eq!(
            SnapshotRequest::from_seq(17).to_json(),
            br#"{"from_seq":17}"#
        );
        assert_eq!(
            SnapshotRequest::from_json(b"{}").expect("full"),
            SnapshotRequest::full()
        );
        assert_eq!(
            SnapshotRequest::from_json(br#"{"from_seq":3,"x":1}"#).expect("replay"),
            SnapshotRequest::from_seq(3)
        );
        assert!(SnapshotRequest::from_json(b"5").is_err());
    }

    #[test]
    fn replies_round_trip() {
        let batch = EventBatch {
            instance_id: InstanceId(1),
            dp_rank: 0,
            tier: Default::default(),
            seq: 5,
            events: vec![KvEvent::Cleared],
        };
        let events = SnapshotReply::Events {
            batches: vec![batch],
            last_seq: 5,
        };
        let json: serde_json::Value = serde_json::from_slice(&events.to_json()).expect("json");
        assert_eq!(json["kind"], "events");
        assert_eq!(json["last_seq"], 5);
        assert_eq!(
            SnapshotReply::from_json(&events.to_json()).expect("decode"),
            events
        );

        let snapshot = SnapshotReply::Snapshot {
            events: vec![RankedEvent {
                dp_rank: 1,
                tier: Default::default(),
                event: KvEvent::stored(None, [(ExternalHash(1), LocalBlockHash(2))]),
            }],
            last_seq: 9,
        };
        let json: serde_json::Value = serde_json::from_slice(&snapshot.to_json()).expect("json");
        assert_eq!(json["kind"], "snapshot");
        assert_eq!(json["events"][0]["type"], "stored");
        assert_eq!(json["events"][0]["dp_rank"], 1);
        let back = SnapshotReply::from_json(&snapshot.to_json()).expect("decode");
        assert_eq!(back, snapshot);
        assert_eq!(back.last_seq(), 9);
    }
}

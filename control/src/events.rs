//! KV event batches on NATS (docs/control-plane.md, "NATS: KV events"): JSON with hashes as
//! 16-digit hex strings, converted losslessly to and from [`kvmesh_kv::KvEvent`].

use kvmesh_kv::{
    BlockParent, CacheTier, ExternalHash, KvEvent, LocalBlockHash, SequenceHash, StoredBlock,
};
use serde::ser::{SerializeMap, SerializeStruct};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::ids::{HexU64, InstanceId};

/// One batch of KV events from one instance's data-parallel rank, numbered by the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventBatch {
    /// The publishing instance.
    pub instance_id: InstanceId,
    /// The data-parallel rank whose cache changed (0 for single-rank engines).
    #[serde(default)]
    pub dp_rank: u32,
    /// The cache tier that changed: `"tier": "host"` or `"disk"`, absent for the device.
    #[serde(default, with = "tier_name", skip_serializing_if = "is_device")]
    pub tier: CacheTier,
    /// The agent's batch counter for this instance: starts at 1, grows by exactly 1 per batch
    /// across all ranks, so `seq > last + 1` means batches were missed.
    pub seq: u64,
    /// The changes, in order.
    #[serde(with = "kv_event_list")]
    pub events: Vec<KvEvent>,
}

impl EventBatch {
    /// The batch as its JSON payload.
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.events.len() * 96);
        self.write_json(&mut out);
        out
    }

    /// Appends the batch's JSON payload to `out` (reuse one buffer on hot paths).
    pub fn write_json(&self, out: &mut Vec<u8>) {
        // Writing hex strings and integers into a Vec cannot fail.
        let _ = serde_json::to_writer(out, self);
    }

    /// Parses a JSON payload.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// Appends the batch's JSON payload as published live to `out`: with `at_ms`, when its
    /// agent numbered it (Unix milliseconds), from which a proxy measures how late its intake
    /// takes it. Batches replayed in resync answers carry no time.
    pub fn write_json_at(&self, at_ms: u64, out: &mut Vec<u8>) {
        let stamped = StampedRef {
            instance_id: self.instance_id,
            dp_rank: self.dp_rank,
            tier: self.tier,
            seq: self.seq,
            at_ms,
            events: &self.events,
        };
        // Writing hex strings and integers into a Vec cannot fail.
        let _ = serde_json::to_writer(out, &stamped);
    }

    /// Parses a JSON payload and its `at_ms`, when it has one (agents before it had none).
    pub fn from_json_at(bytes: &[u8]) -> Result<(Self, Option<u64>), serde_json::Error> {
        let stamped: Stamped = serde_json::from_slice(bytes)?;
        let batch = Self {
            instance_id: stamped.instance_id,
            dp_rank: stamped.dp_rank,
            tier: stamped.tier,
            seq: stamped.seq,
            events: stamped.events,
        };
        Ok((batch, stamped.at_ms))
    }

    /// Number of blocks named by the batch's Stored and Removed events.
    pub fn block_count(&self) -> usize {
        self.events.iter().map(event_blocks).sum()
    }
}

/// A live batch's wire form, written: [`EventBatch`]'s fields and `at_ms`.
#[derive(Serialize)]
struct StampedRef<'a> {
    instance_id: InstanceId,
    dp_rank: u32,
    #[serde(with = "tier_name", skip_serializing_if = "is_device")]
    tier: CacheTier,
    seq: u64,
    at_ms: u64,
    #[serde(serialize_with = "kv_event_list::serialize")]
    events: &'a [KvEvent],
}

/// A batch's wire form, read with its `at_ms` when present.
#[derive(Deserialize)]
struct Stamped {
    instance_id: InstanceId,
    #[serde(default)]
    dp_rank: u32,
    #[serde(default, with = "tier_name")]
    tier: CacheTier,
    seq: u64,
    #[serde(default)]
    at_ms: Option<u64>,
    #[serde(with = "kv_event_list")]
    events: Vec<KvEvent>,
}

fn is_device(tier: &CacheTier) -> bool {
    *tier == CacheTier::Device
}

/// `serde(with)` for a [`CacheTier`] by its name (`device`, `host`, `disk`).
mod tier_name {
    use super::*;

    pub(super) fn serialize<S: Serializer>(tier: &CacheTier, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(tier.as_str())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<CacheTier, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        CacheTier::from_name(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown cache tier {name:?} (device, host or disk)"
            ))
        })
    }
}

/// Number of blocks a Stored or Removed event names (0 for Cleared).
pub fn event_blocks(event: &KvEvent) -> usize {
    match event {
        KvEvent::Stored { blocks, .. } => blocks.len(),
        KvEvent::Removed { blocks } => blocks.len(),
        KvEvent::Cleared => 0,
    }
}

/// The block a Stored chain continues from, as on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireParent {
    /// The agent's 64-bit id of the engine's parent block.
    pub external: HexU64,
    /// kvmesh's sequence hash of the parent block.
    pub sequence: HexU64,
}

/// One stored block, as on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireBlock {
    /// The agent's 64-bit id of the engine's block.
    pub external: HexU64,
    /// kvmesh's local hash of the block's tokens.
    pub local: HexU64,
    /// kvmesh's sequence hash of the block.
    pub sequence: HexU64,
}

/// A KV event as on the wire: `{"type":"stored"|"removed"|"cleared", ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum WireEvent {
    /// A chain of stored blocks, parent first.
    Stored {
        /// The block before `blocks[0]`; absent or null when the chain starts a sequence.
        #[serde(default)]
        parent: Option<WireParent>,
        /// The stored blocks.
        blocks: Vec<WireBlock>,
    },
    /// Evicted blocks, by engine id.
    Removed {
        /// The agent's ids of the evicted engine blocks.
        blocks: Vec<HexU64>,
    },
    /// The instance dropped its whole cache.
    Cleared,
}

impl From<&KvEvent> for WireEvent {
    fn from(event: &KvEvent) -> Self {
        match event {
            KvEvent::Stored { parent, blocks } => Self::Stored {
                parent: parent.map(|p| WireParent {
                    external: HexU64(p.external.0),
                    sequence: HexU64(p.sequence.0),
                }),
                blocks: blocks
                    .iter()
                    .map(|b| WireBlock {
                        external: HexU64(b.external.0),
                        local: HexU64(b.local.0),
                        sequence: HexU64(b.sequence.0),
                    })
                    .collect(),
            },
            KvEvent::Removed { blocks } => Self::Removed {
                blocks: blocks.iter().map(|b| HexU64(b.0)).collect(),
            },
            KvEvent::Cleared => Self::Cleared,
        }
    }
}

impl From<WireEvent> for KvEvent {
    fn from(event: WireEvent) -> Self {
        match event {
            WireEvent::Stored { parent, blocks } => Self::Stored {
                parent: parent.map(|p| BlockParent {
                    external: ExternalHash(p.external.0),
                    sequence: SequenceHash(p.sequence.0),
                }),
                blocks: blocks
                    .into_iter()
                    .map(|b| StoredBlock {
                        external: ExternalHash(b.external.0),
                        local: LocalBlockHash(b.local.0),
                        sequence: SequenceHash(b.sequence.0),
                    })
                    .collect(),
            },
            WireEvent::Removed { blocks } => Self::Removed {
                blocks: blocks.into_iter().map(|b| ExternalHash(b.0)).collect(),
            },
            WireEvent::Cleared => Self::Cleared,
        }
    }
}

/// Serialises a [`KvEvent`] straight to the wire form, without building a [`WireEvent`].
struct EventRef<'a> {
    event: &'a KvEvent,
    /// Written as a `dp_rank` field when set (snapshot events).
    dp_rank: Option<u32>,
    /// Written as a `tier` field when set (snapshot events of a lower tier).
    tier: Option<CacheTier>,
}

struct BlockRef<'a>(&'a StoredBlock);

impl Serialize for BlockRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("WireBlock", 3)?;
        st.serialize_field("external", &HexU64(self.0.external.0))?;
        st.serialize_field("local", &HexU64(self.0.local.0))?;
        st.serialize_field("sequence", &HexU64(self.0.sequence.0))?;
        st.end()
    }
}

struct Blocks<'a>(&'a [StoredBlock]);

impl Serialize for Blocks<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(BlockRef))
    }
}

struct Externals<'a>(&'a [ExternalHash]);

impl Serialize for Externals<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|b| HexU64(b.0)))
    }
}

impl Serialize for EventRef<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        match self.event {
            KvEvent::Stored { parent, blocks } => {
                map.serialize_entry("type", "stored")?;
                let parent = parent.map(|p| WireParent {
                    external: HexU64(p.external.0),
                    sequence: HexU64(p.sequence.0),
                });
                map.serialize_entry("parent", &parent)?;
                map.serialize_entry("blocks", &Blocks(blocks))?;
            }
            KvEvent::Removed { blocks } => {
                map.serialize_entry("type", "removed")?;
                map.serialize_entry("blocks", &Externals(blocks))?;
            }
            KvEvent::Cleared => map.serialize_entry("type", "cleared")?,
        }
        if let Some(rank) = self.dp_rank {
            map.serialize_entry("dp_rank", &rank)?;
        }
        if let Some(tier) = self.tier {
            map.serialize_entry("tier", tier.as_str())?;
        }
        map.end()
    }
}

/// `serde(with)` for a list of [`KvEvent`]s in the wire form.
mod kv_event_list {
    use super::*;

    pub(super) fn serialize<S: Serializer>(events: &[KvEvent], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(events.iter().map(|event| EventRef {
            event,
            dp_rank: None,
            tier: None,
        }))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<KvEvent>, D::Error> {
        let wire = Vec::<WireEvent>::deserialize(d)?;
        Ok(wire.into_iter().map(KvEvent::from).collect())
    }
}

/// An event of a full snapshot, with the data-parallel rank and the tier whose cache holds it
/// (on the wire, `dp_rank` and `tier` fields beside `type`, omitted for rank 0 and the
/// device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankedEvent {
    /// The rank whose cache the event describes.
    pub dp_rank: u32,
    /// The tier of that rank's cache.
    pub tier: CacheTier,
    /// The event.
    pub event: KvEvent,
}

impl Serialize for RankedEvent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        EventRef {
            event: &self.event,
            dp_rank: (self.dp_rank != 0).then_some(self.dp_rank),
            tier: (!is_device(&self.tier)).then_some(self.tier),
        }
        .serialize(s)
    }
}

#[derive(Deserialize)]
struct RankedWire {
    #[serde(default)]
    dp_rank: u32,
    #[serde(default, with = "tier_name")]
    tier: CacheTier,
    #[serde(flatten)]
    event: WireEvent,
}

impl<'de> Deserialize<'de> for RankedEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let wire = RankedWire::deserialize(d)?;
        Ok(Self {
            dp_rank: wire.dp_rank,
            tier: wire.tier,
            event: wire.event.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvEvent {
        KvEvent::stored(
            Some(BlockParent {
                external: ExternalHash(0xabc),
                sequence: SequenceHash(u64::MAX),
            }),
            [
                (ExternalHash(1), LocalBlockHash(10)),
                (ExternalHash(2), LocalBlockHash(20)),
            ],
        )
    }

    fn batch() -> EventBatch {
        EventBatch {
            instance_id: InstanceId(0x00c0_ffee_00c0_ffee),
            dp_rank: 0,
            tier: Default::default(),
            seq: 42,
            events: vec![
                stored(),
                KvEvent::stored(None, [(ExternalHash(3), LocalBlockHash(30))]),
                KvEvent::Removed {
                    blocks: vec![ExternalHash(1), ExternalHash(u64::MAX)],
                },
                KvEvent::Cleared,
            ],
        }
    }

    #[test]
    fn batches_round_trip_losslessly() {
        let b = batch();
        let json = b.to_json();
        assert_eq!(EventBatch::from_json(&json).expect("decode"), b);
        assert_eq!(b.block_count(), 5);
        for event in &b.events {
            assert_eq!(KvEvent::from(WireEvent::from(event)), *event);
        }
    }

    #[test]
    fn wire_form_matches_the_documented_shape() {
        let value: serde_json::Value = serde_json::from_slice(&batch().to_json()).expect("json");
        assert_eq!(value["instance_id"], "00c0ffee00c0ffee");
        assert_eq!(value["seq"], 42);
        let first = &value["events"][0];
        assert_eq!(first["type"], "stored");
        assert_eq!(first["parent"]["external"], "0000000000000abc");
        assert_eq!(first["parent"]["sequence"], "ffffffffffffffff");
        assert_eq!(first["blocks"][0]["external"], "0000000000000001");
        assert_eq!(first["blocks"][0]["local"], "000000000000000a");
        assert!(value["events"][1]["parent"].is_null());
        assert_eq!(value["events"][2]["blocks"][1], "ffffffffffffffff");
        assert_eq!(value["events"][3], serde_json::json!({"type": "cleared"}));
        assert!(first.get("dp_rank").is_none());
    }

    #[test]
    fn documented_example_parses() {
        let json = r#"{"instance_id":"00c0ffee00c0ffee","dp_rank":0,"seq":42,
          "events":[
            {"type":"stored","parent":{"external":"01","sequence":"02"},
             "blocks":[{"external":"03","local":"04","sequence":"05"}]},
            {"type":"stored","blocks":[{"external":"06","local":"07","sequence":"08"}]},
            {"type":"removed","blocks":["03"]},
            {"type":"cleared","future":1}]}"#;
        let b = EventBatch::from_json(json.as_bytes()).expect("doc example");
        assert_eq!(b.events.len(), 4);
        let KvEvent::Stored { parent, blocks } = &b.events[0] else {
            panic!("not stored");
        };
        assert_eq!(parent.map(|p| p.sequence), Some(SequenceHash(2)));
        assert_eq!(blocks[0].local, LocalBlockHash(4));
        assert!(matches!(&b.events[1], KvEvent::Stored { parent: None, .. }));
        for bad in [
            r#"{"instance_id":"01","seq":1,"events":[{"type":"moved"}]}"#,
            r#"{"instance_id":"01","seq":1,"events":[{"type":"removed","blocks":[1]}]}"#,
            r#"{"seq":1,"events":[]}"#,
        ] {
            assert!(EventBatch::from_json(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn live_batches_carry_when_their_agent_numbered_them() {
        let b = batch();
        let mut json = Vec::new();
        b.write_json_at(1_732_272_000_123, &mut json);
        let value: serde_json::Value = serde_json::from_slice(&json).expect("json");
        assert_eq!(value["at_ms"], 1_732_272_000_123_u64);
        assert_eq!(value["events"][3], serde_json::json!({"type": "cleared"}));
        assert_eq!(
            EventBatch::from_json_at(&json).expect("decode"),
            (b.clone(), Some(1_732_272_000_123))
        );
        assert_eq!(EventBatch::from_json(&json).expect("decode"), b);
        // An older agent's batch, and a replayed one: no time.
        assert_eq!(
            EventBatch::from_json_at(&b.to_json()).expect("decode"),
            (b, None)
        );
        for bad in [
            r#"{"instance_id":"01","seq":1,"at_ms":-1,"events":[]}"#,
            r#"{"instance_id":"01","seq":1,"at_ms":1,"events":[{"type":"moved"}]}"#,
            r#"{"seq":1,"at_ms":1,"events":[]}"#,
        ] {
            assert!(EventBatch::from_json_at(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn ranked_events_carry_nonzero_ranks() {
        for dp_rank in [0, 3] {
            let e = RankedEvent {
                dp_rank,
                tier: Default::default(),
                event: stored(),
            };
            let json = serde_json::to_value(&e).expect("encode");
            assert_eq!(json.get("dp_rank").is_some(), dp_rank != 0);
            let back: RankedEvent = serde_json::from_value(json).expect("decode");
            assert_eq!(back, e);
        }
    }

    #[test]
    fn a_lower_tier_is_named_and_the_device_left_out() {
        for tier in CacheTier::ALL {
            let batch = EventBatch { tier, ..batch() };
            let json: serde_json::Value = serde_json::from_slice(&batch.to_json()).expect("json");
            let named = (tier != CacheTier::Device).then(|| tier.as_str());
            assert_eq!(json.get("tier").and_then(|t| t.as_str()), named);
            assert_eq!(
                EventBatch::from_json(&batch.to_json()).expect("decode"),
                batch
            );
            let mut stamped = Vec::new();
            batch.write_json_at(7, &mut stamped);
            assert_eq!(
                EventBatch::from_json_at(&stamped).expect("decode"),
                (batch.clone(), Some(7))
            );
            let ranked = RankedEvent {
                dp_rank: 1,
                tier,
                event: stored(),
            };
            let json = serde_json::to_value(&ranked).expect("encode");
            assert_eq!(json.get("tier").and_then(|t| t.as_str()), named);
            assert_eq!(
                serde_json::from_value::<RankedEvent>(json).expect("decode"),
                ranked
            );
        }
        let unknown = br#"{"instance_id":"0000000000000001","tier":"nvme","seq":1,"events":[]}"#;
        let error = EventBatch::from_json(unknown).expect_err("an unknown tier");
        assert!(error.to_string().contains("unknown cache tier"), "{error}");
    }
}

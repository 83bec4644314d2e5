//! vLLM's msgpack encoding of a KV event batch (wire-formats.md §1.5–§1.7).
//!
//! The batch is always the positional array `[ts: f64, events, data_parallel_rank]`. Events are
//! positional arrays (legacy form, trailing nil fields after `lora_name` omitted) or maps with a
//! `type` key (vLLM PR #42892). Hashes are unsigned 64-bit ints or 32-byte bins.
//!
//! A LoRA adapter's `BlockStored` carries its `lora_id` (an int) and `lora_name` (a string) in
//! both forms, nil for the base model. `extra_keys` hold, per block, the keys vLLM folded into
//! the block hash, in vLLM's order and untagged shapes (`to_event_extra_keys`): the adapter's
//! name on every block of an adapter, then the request's `cache_salt` (a bare string) on the
//! first block of a sequence (an event without a parent); nil for a block with neither. The
//! map form always has them; the positional form stops at `lora_name` unless the event carries
//! a salt, which it writes at position 8 as vLLM's positional encoding does.
//!
//! Host-tier events (`medium: "CPU"`, vLLM's OffloadingConnector) have the device events'
//! layout with these differences, as vLLM 0.32.0's `OffloadingEventsTracker` writes them: a
//! `BlockStored` has no `extra_keys` (nor a salt in the positional form), and the map form
//! has `kv_cache_spec_kind` only when the event describes its block (`block_size` > 0): a
//! placeholder store (`block_size` 0, no tokens) stops at `group_idx`.

use std::sync::Arc;

use crate::config::{KvEventEncoding, KvEventHash};
use crate::hashing::EngineHash;
use crate::kv_events::{KvEvent, Medium};
use crate::lora::Lora;

/// Attention kind of the only KV cache group.
const SPEC_KIND: &str = "full_attention";

/// Layout choices of the encoded events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WireFormat {
    /// Positional arrays or maps.
    pub encoding: KvEventEncoding,
    /// Integer or 32-byte hashes.
    pub hash: KvEventHash,
}

/// A msgpack writer over a `Vec`, which cannot fail to grow, so results are not propagated.
struct Writer<'a> {
    out: &'a mut Vec<u8>,
    hash: KvEventHash,
}

/// Collection lengths always fit: nothing in memory holds 2^32 events, blocks or tokens.
fn len32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

impl Writer<'_> {
    fn array(&mut self, len: usize) {
        let _ = rmp::encode::write_array_len(self.out, len32(len));
    }

    fn map(&mut self, len: usize) {
        let _ = rmp::encode::write_map_len(self.out, len32(len));
    }

    fn str(&mut self, s: &str) {
        let _ = rmp::encode::write_str(self.out, s);
    }

    fn uint(&mut self, v: u64) {
        let _ = rmp::encode::write_uint(self.out, v);
    }

    fn nil(&mut self) {
        let _ = rmp::encode::write_nil(self.out);
    }

    fn f64(&mut self, v: f64) {
        let _ = rmp::encode::write_f64(self.out, v);
    }

    fn hash(&mut self, h: &EngineHash) {
        match self.hash {
            KvEventHash::Int => self.uint(h.id()),
            KvEventHash::Bytes => {
                let _ = rmp::encode::write_bin(self.out, h.digest());
            }
        }
    }

    fn hashes(&mut self, hashes: &[EngineHash]) {
        self.array(hashes.len());
        for h in hashes {
            self.hash(h);
        }
    }

    fn optional_hash(&mut self, h: Option<&EngineHash>) {
        match h {
            Some(h) => self.hash(h),
            None => self.nil(),
        }
    }

    fn lora_id(&mut self, lora: Option<&Lora>) {
        match lora {
            Some(l) => self.uint(l.id),
            None => self.nil(),
        }
    }

    fn lora_name(&mut self, lora: Option<&Lora>) {
        match lora {
            Some(l) => self.str(&l.name),
            None => self.nil(),
        }
    }

    /// Per block, the keys vLLM folded into its hash: `[lora_name?, cache_salt?]`, the salt
    /// on the first block only (it is set only on events that start a sequence).
    fn extra_keys(&mut self, blocks: usize, lora: Option<&Lora>, salt: Option<&Arc<str>>) {
        self.array(blocks);
        for block in 0..blocks {
            let salt = salt.filter(|_| block == 0);
            let n = usize::from(lora.is_some()) + usize::from(salt.is_some());
            if n == 0 {
                self.nil();
                continue;
            }
            self.array(n);
            if let Some(l) = lora {
                self.str(&l.name);
            }
            if let Some(salt) = salt {
                self.str(salt);
            }
        }
    }

    fn tokens(&mut self, tokens: &[u32]) {
        self.array(tokens.len());
        for &t in tokens {
            self.uint(u64::from(t));
        }
    }

    fn positional(&mut self, event: &KvEvent) {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora,
                cache_salt,
                medium,
            } => {
                self.array(if cache_salt.is_some() { 9 } else { 8 });
                self.str("BlockStored");
                self.hashes(block_hashes);
                self.optional_hash(parent_block_hash.as_ref());
                self.tokens(token_ids);
                self.uint(*block_size as u64);
                self.lora_id(lora.as_ref());
                self.str(medium.as_str());
                self.lora_name(lora.as_ref());
                if cache_salt.is_some() {
                    self.extra_keys(block_hashes.len(), lora.as_ref(), cache_salt.as_ref());
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                self.array(3);
                self.str("BlockRemoved");
                self.hashes(block_hashes);
                self.str(medium.as_str());
            }
            KvEvent::AllBlocksCleared => {
                self.array(1);
                self.str("AllBlocksCleared");
            }
        }
    }

    fn keyed(&mut self, event: &KvEvent) {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora,
                cache_salt,
                medium,
            } => {
                let device = *medium == Medium::Gpu;
                // vLLM's offload events have no extra_keys; a placeholder has no spec kind.
                let spec_kind = device || *block_size > 0;
                self.map(9 + usize::from(device) + usize::from(spec_kind));
                self.str("type");
                self.str("BlockStored");
                self.str("block_hashes");
                self.hashes(block_hashes);
                self.str("parent_block_hash");
                self.optional_hash(parent_block_hash.as_ref());
                self.str("token_ids");
                self.tokens(token_ids);
                self.str("block_size");
                self.uint(*block_size as u64);
                self.str("lora_id");
                self.lora_id(lora.as_ref());
                self.str("medium");
                self.str(medium.as_str());
                self.str("lora_name");
                self.lora_name(lora.as_ref());
                if device {
                    self.str("extra_keys");
                    self.extra_keys(block_hashes.len(), lora.as_ref(), cache_salt.as_ref());
                }
                self.str("group_idx");
                self.uint(0);
                if spec_kind {
                    self.str("kv_cache_spec_kind");
                    self.str(SPEC_KIND);
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                self.map(4);
                self.str("type");
                self.str("BlockRemoved");
                self.str("block_hashes");
                self.hashes(block_hashes);
                self.str("medium");
                self.str(medium.as_str());
                self.str("group_idx");
                self.uint(0);
            }
            KvEvent::AllBlocksCleared => {
                self.map(1);
                self.str("type");
                self.str("AllBlocksCleared");
            }
        }
    }
}

/// Appends the msgpack batch `[timestamp, [events...], dp_rank]` to `out`.
pub(crate) fn encode_batch(
    out: &mut Vec<u8>,
    format: WireFormat,
    timestamp: f64,
    events: &[KvEvent],
    dp_rank: u32,
) {
    let mut w = Writer {
        out,
        hash: format.hash,
    };
    w.array(3);
    w.f64(timestamp);
    w.array(events.len());
    for event in events {
        match format.encoding {
            KvEventEncoding::Positional => w.positional(event),
            KvEventEncoding::Map => w.keyed(event),
        }
    }
    w.uint(u64::from(dp_rank));
}

#[cfg(test)]
mod tests {
    use rmpv::Value;

    use super::*;

    fn hash(n: u8) -> EngineHash {
        let mut digest = [n; 32];
        digest[31] = 0xFF;
        EngineHash::from_digest(digest)
    }

    fn stored() -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![hash(1), hash(2)],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            lora: None,
            cache_salt: None,
            medium: Medium::Gpu,
        }
    }

    fn adapter_stored() -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![hash(1), hash(2)],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            lora: Some(Lora {
                id: 3,
                name: "sql-lora".into(),
            }),
            cache_salt: None,
            medium: Medium::Gpu,
        }
    }

    fn salted(event: KvEvent, salt: &str) -> KvEvent {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora,
                medium,
                ..
            } => KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora,
                cache_salt: Some(Arc::from(salt)),
                medium,
            },
            other => other,
        }
    }

    fn encode(encoding: KvEventEncoding, hash: KvEventHash, events: &[KvEvent]) -> Value {
        let mut out = Vec::new();
        encode_batch(&mut out, WireFormat { encoding, hash }, 1.5, events, 0);
        let mut slice = out.as_slice();
        let value = rmpv::decode::read_value(&mut slice).expect("valid msgpack");
        assert!(slice.is_empty(), "trailing bytes");
        value
    }

    fn field<'a>(map: &'a Value, key: &str) -> &'a Value {
        map.as_map()
            .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some(key)))
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no {key} in {map}"))
    }

    #[test]
    fn cleared_batch_bytes_are_exact() {
        let mut out = Vec::new();
        let format = WireFormat {
            encoding: KvEventEncoding::Positional,
            hash: KvEventHash::Int,
        };
        encode_batch(&mut out, format, 1.5, &[KvEvent::AllBlocksCleared], 0);
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1.5f64.to_be_bytes());
        expected.extend_from_slice(&[0x91, 0x91, 0xb0]);
        expected.extend_from_slice(b"AllBlocksCleared");
        expected.push(0x00);
        assert_eq!(out, expected);
    }

    #[test]
    fn positional_events_with_int_hashes() {
        let removed = KvEvent::BlockRemoved {
            block_hashes: vec![hash(3)],
            medium: Medium::Gpu,
        };
        let v = encode(
            KvEventEncoding::Positional,
            KvEventHash::Int,
            &[stored(), removed],
        );
        let batch = v.as_array().expect("batch array");
        assert_eq!(batch.len(), 3);
        assert_eq!(batch[0].as_f64(), Some(1.5));
        assert_eq!(batch[2].as_u64(), Some(0));
        let events = batch[1].as_array().expect("events");
        let s = events[0].as_array().expect("stored array");
        assert_eq!(s.len(), 8);
        assert_eq!(s[0].as_str(), Some("BlockStored"));
        let ids: Vec<u64> = s[1]
            .as_array()
            .expect("hashes")
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(ids, vec![hash(1).id(), hash(2).id()]);
        assert!(s[2].is_nil());
        assert_eq!(s[3].as_array().map(Vec::len), Some(4));
        assert_eq!(s[4].as_u64(), Some(2));
        assert!(s[5].is_nil() && s[7].is_nil());
        assert_eq!(s[6].as_str(), Some("GPU"));
        let r = events[1].as_array().expect("removed array");
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].as_str(), Some("BlockRemoved"));
        assert_eq!(r[1][0].as_u64(), Some(hash(3).id()));
        assert_eq!(r[2].as_str(), Some("GPU"));
    }

    #[test]
    fn map_events_with_byte_hashes() {
        let child = KvEvent::BlockStored {
            block_hashes: vec![hash(2)],
            parent_block_hash: Some(hash(1)),
            token_ids: vec![3, 4],
            block_size: 2,
            lora: None,
            cache_salt: None,
            medium: Medium::Gpu,
        };
        let v = encode(
            KvEventEncoding::Map,
            KvEventHash::Bytes,
            &[child, KvEvent::AllBlocksCleared],
        );
        let events = v[1].as_array().expect("events");
        let s = &events[0];
        assert_eq!(field(s, "type").as_str(), Some("BlockStored"));
        assert_eq!(
            field(s, "block_hashes")[0].as_slice(),
            Some(&hash(2).digest()[..])
        );
        assert_eq!(
            field(s, "parent_block_hash").as_slice(),
            Some(&hash(1).digest()[..])
        );
        assert_eq!(field(s, "block_size").as_u64(), Some(2));
        assert_eq!(field(s, "medium").as_str(), Some("GPU"));
        assert!(field(s, "lora_id").is_nil() && field(s, "lora_name").is_nil());
        assert_eq!(field(s, "extra_keys").as_array().map(Vec::len), Some(1));
        assert_eq!(field(s, "group_idx").as_u64(), Some(0));
        assert_eq!(
            field(s, "kv_cache_spec_kind").as_str(),
            Some("full_attention")
        );
        assert_eq!(s.as_map().map(Vec::len), Some(11));
        assert_eq!(field(&events[1], "type").as_str(), Some("AllBlocksCleared"));
    }

    #[test]
    fn adapter_stores_carry_lora_id_and_name_in_both_forms() {
        let v = encode(
            KvEventEncoding::Positional,
            KvEventHash::Int,
            &[adapter_stored()],
        );
        let s = v[1][0].as_array().expect("stored array");
        assert_eq!(s.len(), 8, "{v}");
        assert_eq!(s[5].as_u64(), Some(3), "lora_id at position 5");
        assert_eq!(s[6].as_str(), Some("GPU"));
        assert_eq!(s[7].as_str(), Some("sql-lora"), "lora_name at position 7");

        let v = encode(KvEventEncoding::Map, KvEventHash::Int, &[adapter_stored()]);
        let s = &v[1][0];
        assert_eq!(s.as_map().map(Vec::len), Some(11));
        assert_eq!(field(s, "lora_id").as_u64(), Some(3));
        assert_eq!(field(s, "lora_name").as_str(), Some("sql-lora"));
        let name = Value::from("sql-lora");
        assert_eq!(
            field(s, "extra_keys"),
            &Value::Array(vec![
                Value::Array(vec![name.clone()]),
                Value::Array(vec![name])
            ])
        );
    }

    #[test]
    fn salted_stores_list_the_salt_after_the_lora_name_on_the_first_block() {
        let name = Value::from("sql-lora");
        let salt = Value::from("tenant-a");
        let v = encode(
            KvEventEncoding::Map,
            KvEventHash::Int,
            &[
                salted(stored(), "tenant-a"),
                salted(adapter_stored(), "tenant-a"),
            ],
        );
        assert_eq!(
            field(&v[1][0], "extra_keys"),
            &Value::Array(vec![Value::Array(vec![salt.clone()]), Value::Nil])
        );
        assert_eq!(
            field(&v[1][1], "extra_keys"),
            &Value::Array(vec![
                Value::Array(vec![name.clone(), salt.clone()]),
                Value::Array(vec![name.clone()])
            ])
        );
        // The positional form writes extra_keys at position 8 when there is a salt.
        let v = encode(
            KvEventEncoding::Positional,
            KvEventHash::Int,
            &[salted(adapter_stored(), "tenant-a")],
        );
        let s = v[1][0].as_array().expect("stored array");
        assert_eq!(s.len(), 9, "{v}");
        assert_eq!(
            s[8],
            Value::Array(vec![
                Value::Array(vec![name.clone(), salt]),
                Value::Array(vec![name])
            ])
        );
    }

    fn keys(event: &Value) -> Vec<&str> {
        event
            .as_map()
            .expect("a map")
            .iter()
            .filter_map(|(k, _)| k.as_str())
            .collect()
    }

    fn host_stored(placeholder: bool) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![hash(2)],
            parent_block_hash: (!placeholder).then(|| hash(1)),
            token_ids: if placeholder { Vec::new() } else { vec![3, 4] },
            block_size: if placeholder { 0 } else { 2 },
            lora: (!placeholder).then(|| Lora {
                id: 3,
                name: "sql-lora".into(),
            }),
            cache_salt: None,
            medium: Medium::Cpu,
        }
    }

    #[test]
    fn host_tier_events_have_the_offloading_connectors_fields() {
        let removed = KvEvent::BlockRemoved {
            block_hashes: vec![hash(4), hash(5)],
            medium: Medium::Cpu,
        };
        let v = encode(
            KvEventEncoding::Map,
            KvEventHash::Int,
            &[host_stored(true), host_stored(false), removed.clone()],
        );
        let events = v[1].as_array().expect("events");
        let placeholder = &events[0];
        assert_eq!(
            keys(placeholder),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "group_idx"
            ]
        );
        assert_eq!(field(placeholder, "medium").as_str(), Some("CPU"));
        assert_eq!(field(placeholder, "block_size").as_u64(), Some(0));
        assert!(field(placeholder, "parent_block_hash").is_nil());
        assert_eq!(
            field(placeholder, "token_ids").as_array().map(Vec::len),
            Some(0)
        );
        let full = &events[1];
        assert_eq!(keys(full)[..9], keys(placeholder)[..]);
        assert_eq!(keys(full)[9..], ["kv_cache_spec_kind"]);
        assert_eq!(
            field(full, "parent_block_hash").as_u64(),
            Some(hash(1).id())
        );
        assert_eq!(field(full, "lora_id").as_u64(), Some(3));
        assert_eq!(field(full, "lora_name").as_str(), Some("sql-lora"));
        assert_eq!(
            keys(&events[2]),
            ["type", "block_hashes", "medium", "group_idx"]
        );
        assert_eq!(field(&events[2], "medium").as_str(), Some("CPU"));

        let v = encode(
            KvEventEncoding::Positional,
            KvEventHash::Int,
            &[host_stored(true), removed],
        );
        let s = v[1][0].as_array().expect("stored array");
        assert_eq!(s.len(), 8);
        assert_eq!(s[4].as_u64(), Some(0));
        assert_eq!(s[6].as_str(), Some("CPU"));
        let r = v[1][1].as_array().expect("removed array");
        assert_eq!(r[2].as_str(), Some("CPU"));
    }
}

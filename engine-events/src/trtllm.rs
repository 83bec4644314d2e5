//! TensorRT-LLM's KV cache events, as trtllm-serve's `POST /kv_cache_events` returns them: a
//! JSON array of `{event_id, data: {type, ...}, window_size?, attention_dp_rank?}`, oldest
//! first (`tests/fixtures/trtllm/README.md` at the repository root describes the format and
//! how the fixtures were made with TensorRT-LLM's own serializer).
//!
//! [`decode_trtllm_events`] reads one answer; [`TrtllmView`] turns its events, one rank's at a
//! time, into the [`EngineEvent`]s the agent translates: full blocks stored (the agent
//! re-hashes their token ids), partial blocks dropped and remembered so that their removal is
//! no miss, events of attention windows smaller than the largest one skipped, and a `created`
//! after blocks were seen turned into [`EngineEvent::Cleared`]. Event numbers (`event_id`) are
//! the caller's to track: a jump means lost events, a return to 0 a restarted engine.
//! No I/O here.

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use crate::batch::{EngineEvent, IgnoreReason, fold_hash_bytes};

/// One TensorRT-LLM KV cache event.
#[derive(Debug, Clone, PartialEq)]
pub struct TrtllmEvent {
    /// Its number: per attention-DP rank, +1 per event, from 0 at engine start.
    pub event_id: u64,
    /// `attention_dp_rank` (0 when absent: no attention data parallelism).
    pub dp_rank: u32,
    /// The attention window it is about (absent in older versions, which have one).
    pub window_size: Option<u64>,
    /// What happened.
    pub data: TrtllmData,
}

/// The `data` of a [`TrtllmEvent`].
#[derive(Debug, Clone, PartialEq)]
pub enum TrtllmData {
    /// The KV cache of a window was made (engine start): its blocks per cache level (GPU,
    /// host).
    Created {
        /// `num_blocks_per_cache_level`.
        blocks_per_cache_level: Vec<u64>,
    },
    /// Blocks became reusable, in sequence order.
    Stored {
        /// The engine id of the block before the first (`None`: at the root).
        parent: Option<u64>,
        /// The blocks.
        blocks: Vec<TrtllmBlock>,
    },
    /// Blocks were evicted from the reuse tree.
    Removed {
        /// Their engine ids.
        block_hashes: Vec<u64>,
    },
    /// A block moved between cache levels or its retention priority changed.
    Updated {
        /// Its engine id.
        block_hash: u64,
        /// `(old, new)` cache level, when that changed (0: GPU, 1: host memory).
        cache_level: Option<(u64, u64)>,
    },
    /// A `type` this decoder does not know.
    Unknown,
}

/// One block of a `stored` event.
#[derive(Debug, Clone, PartialEq)]
pub struct TrtllmBlock {
    /// Its engine id (`block_hash`).
    pub block_hash: u64,
    /// Its tokens' `token_id`s.
    pub token_ids: Vec<u32>,
    /// Whether its key holds more than token ids (a non-zero `token_extra_id`, or multimodal
    /// `mm_keys`), which kvmesh cannot reproduce.
    pub extra_keys: bool,
    /// `cache_level` (0: GPU).
    pub cache_level: u64,
    /// `cache_salt` (newer versions), when set.
    pub cache_salt: Option<String>,
}

/// One decoded answer of `POST /kv_cache_events`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TrtllmPoll {
    /// The events, oldest first.
    pub events: Vec<TrtllmEvent>,
    /// Events that could not be read (skipped: their numbers are missing from `events`).
    pub malformed_events: usize,
    /// Why the first of them could not be.
    pub malformed_reason: Option<String>,
}

/// Decodes one answer of trtllm-serve's `POST /kv_cache_events`: a JSON array of events.
/// Unknown fields are ignored; an event that cannot be read is skipped and counted; an answer
/// that is not a JSON array is refused.
pub fn decode_trtllm_events(body: &[u8]) -> Result<TrtllmPoll, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the answer is not JSON: {e}"))?;
    let Value::Array(items) = value else {
        return Err("the answer is not a JSON array of events".to_owned());
    };
    let mut poll = TrtllmPoll {
        events: Vec::with_capacity(items.len()),
        ..TrtllmPoll::default()
    };
    for item in &items {
        match event(item) {
            Ok(event) => poll.events.push(event),
            Err(why) => {
                poll.malformed_events += 1;
                poll.malformed_reason.get_or_insert(why);
            }
        }
    }
    Ok(poll)
}

fn field<'a>(object: &'a Value, name: &str) -> Option<&'a Value> {
    object.get(name).filter(|v| !v.is_null())
}

fn unsigned(value: &Value, what: &str) -> Result<u64, String> {
    value
        .as_u64()
        .ok_or_else(|| format!("{what} must be an unsigned integer, not {value}"))
}

/// A block hash: an integer up to 2⁶⁴ − 1 (a negative one is bit-cast), or a hex string (the
/// KV cache manager v2's digests), folded like a byte-string hash ([`fold_hash_bytes`]).
fn hash(value: &Value) -> Result<u64, String> {
    if let Some(h) = value.as_u64() {
        return Ok(h);
    }
    if let Some(h) = value.as_i64() {
        return Ok(h as u64);
    }
    let Some(text) = value.as_str() else {
        return Err(format!(
            "a block hash must be an integer or a string, not {value}"
        ));
    };
    let digits = text.strip_prefix("0x").unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("block hash {text:?} is not hexadecimal"));
    }
    let padded = if digits.len() % 2 == 1 {
        format!("0{digits}")
    } else {
        digits.to_owned()
    };
    let bytes: Vec<u8> = padded
        .as_bytes()
        .chunks(2)
        .map(|pair| {
            let pair = std::str::from_utf8(pair).unwrap_or("00");
            u8::from_str_radix(pair, 16).unwrap_or(0)
        })
        .collect();
    Ok(fold_hash_bytes(&bytes))
}

fn hashes(value: Option<&Value>, what: &str) -> Result<Vec<u64>, String> {
    let Some(Value::Array(items)) = value else {
        return Err(format!("{what} must be an array"));
    };
    items.iter().map(hash).collect()
}

/// `{"type": "event_diff", "old_value", "new_value"}` of an `updated` event.
fn diff(value: Option<&Value>) -> Result<Option<(u64, u64)>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    let side = |name: &str| {
        field(value, name)
            .ok_or_else(|| format!("an event_diff without {name}"))
            .and_then(|v| unsigned(v, name))
    };
    Ok(Some((side("old_value")?, side("new_value")?)))
}

fn block(value: &Value) -> Result<TrtllmBlock, String> {
    let block_hash = hash(field(value, "block_hash").ok_or("a block without block_hash")?)?;
    let Some(Value::Array(tokens)) = field(value, "tokens") else {
        return Err("a block without tokens".to_owned());
    };
    let mut extra_keys = false;
    let mut token_ids = Vec::with_capacity(tokens.len());
    for token in tokens {
        let id = match token {
            Value::Number(_) => token,
            _ => {
                let extra = field(token, "token_extra_id")
                    .map_or(Ok(0), |v| unsigned(v, "token_extra_id"))?;
                extra_keys |= extra != 0;
                field(token, "token_id").ok_or("a token without token_id")?
            }
        };
        let id = unsigned(id, "token_id")?;
        token_ids.push(u32::try_from(id).map_err(|_| format!("token id {id} is too large"))?);
    }
    extra_keys |= field(value, "mm_keys")
        .and_then(Value::as_array)
        .is_some_and(|keys| !keys.is_empty());
    Ok(TrtllmBlock {
        block_hash,
        token_ids,
        extra_keys,
        cache_level: field(value, "cache_level").map_or(Ok(0), |v| unsigned(v, "cache_level"))?,
        cache_salt: field(value, "cache_salt")
            .and_then(Value::as_str)
            .filter(|salt| !salt.is_empty())
            .map(str::to_owned),
    })
}

fn event(value: &Value) -> Result<TrtllmEvent, String> {
    if !value.is_object() {
        return Err(format!("an event must be an object, not {value}"));
    }
    let event_id = unsigned(
        field(value, "event_id").ok_or("an event without event_id")?,
        "event_id",
    )?;
    let dp_rank = match field(value, "attention_dp_rank") {
        Some(rank) => u32::try_from(unsigned(rank, "attention_dp_rank")?)
            .map_err(|_| "attention_dp_rank is too large".to_owned())?,
        None => 0,
    };
    let window_size = field(value, "window_size")
        .map(|w| unsigned(w, "window_size"))
        .transpose()?;
    let data = field(value, "data").ok_or("an event without data")?;
    let kind = field(data, "type")
        .and_then(Value::as_str)
        .ok_or("event data without a type")?;
    let data = match kind {
        "created" => {
            let Some(Value::Array(levels)) = field(data, "num_blocks_per_cache_level") else {
                return Err("a created event without num_blocks_per_cache_level".to_owned());
            };
            TrtllmData::Created {
                blocks_per_cache_level: levels
                    .iter()
                    .map(|n| unsigned(n, "num_blocks_per_cache_level"))
                    .collect::<Result<_, _>>()?,
            }
        }
        "stored" => {
            let Some(Value::Array(blocks)) = field(data, "blocks") else {
                return Err("a stored event without blocks".to_owned());
            };
            TrtllmData::Stored {
                parent: field(data, "parent_hash").map(hash).transpose()?,
                blocks: blocks.iter().map(block).collect::<Result<_, _>>()?,
            }
        }
        "removed" => TrtllmData::Removed {
            block_hashes: hashes(field(data, "block_hashes"), "block_hashes")?,
        },
        "updated" => TrtllmData::Updated {
            block_hash: hash(
                field(data, "block_hash").ok_or("an updated event without block_hash")?,
            )?,
            cache_level: diff(field(data, "cache_level"))?,
        },
        _ => TrtllmData::Unknown,
    };
    Ok(TrtllmEvent {
        event_id,
        dp_rank,
        window_size,
        data,
    })
}

/// What one event became.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TrtllmStep {
    /// The event for the agent to translate, if any.
    pub event: Option<EngineEvent>,
    /// Partial blocks of a `stored` event dropped (a sequence's last block, not full yet).
    pub partial_blocks: usize,
}

impl TrtllmStep {
    fn event(event: EngineEvent) -> Self {
        Self {
            event: Some(event),
            partial_blocks: 0,
        }
    }

    fn ignored(reason: IgnoreReason) -> Self {
        Self::event(EngineEvent::Ignored(reason))
    }
}

/// What is known of one attention-DP rank's events.
#[derive(Debug, Default)]
struct RankView {
    /// A `stored`, `removed` or `updated` event was seen since the rank's last start.
    seen: bool,
    /// Engine ids of partial blocks stored and not removed yet.
    partial: HashSet<u64>,
}

/// The state that turns TensorRT-LLM's events into [`EngineEvent`]s: the largest attention
/// window, and per rank the partial blocks stored and whether blocks were seen.
#[derive(Debug)]
pub struct TrtllmView {
    block_size: usize,
    window: Option<u64>,
    capacity: Option<u64>,
    ranks: HashMap<u32, RankView>,
}

impl TrtllmView {
    /// A view for an engine of `block_size`-token blocks (`tokens_per_block`).
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            window: None,
            capacity: None,
            ranks: HashMap::new(),
        }
    }

    /// The attention window followed: the largest one seen (what Dynamo routes on).
    pub fn window(&self) -> Option<u64> {
        self.window
    }

    /// The GPU blocks of that window's KV cache, as its last `created` event said.
    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// Forgets what rank `rank` held (its engine restarted: the caller publishes the clear),
    /// and the windows: the restarted engine announces its own.
    pub fn restart(&mut self, rank: u32) {
        self.ranks.remove(&rank);
        self.window = None;
    }

    /// Turns one event into what the agent translates.
    pub fn translate(&mut self, event: &TrtllmEvent) -> TrtllmStep {
        if let Some(window) = event.window_size {
            if self.window.is_some_and(|main| window < main) {
                return TrtllmStep::ignored(IgnoreReason::KvGroup);
            }
            self.window = Some(window);
        }
        let rank = self.ranks.entry(event.dp_rank).or_default();
        match &event.data {
            TrtllmData::Created {
                blocks_per_cache_level,
            } => {
                self.capacity = blocks_per_cache_level.first().copied();
                if std::mem::take(&mut rank.seen) {
                    rank.partial.clear();
                    TrtllmStep::event(EngineEvent::Cleared)
                } else {
                    TrtllmStep::default()
                }
            }
            TrtllmData::Stored { parent, blocks } => {
                rank.seen = true;
                stored(self.block_size, rank, *parent, blocks)
            }
            TrtllmData::Removed { block_hashes } => {
                rank.seen = true;
                let block_hashes: Vec<u64> = block_hashes
                    .iter()
                    .copied()
                    .filter(|h| !rank.partial.remove(h))
                    .collect();
                if block_hashes.is_empty() {
                    TrtllmStep::default()
                } else {
                    TrtllmStep::event(EngineEvent::Removed { block_hashes })
                }
            }
            TrtllmData::Updated { .. } => {
                rank.seen = true;
                TrtllmStep::ignored(IgnoreReason::Updated)
            }
            TrtllmData::Unknown => TrtllmStep::ignored(IgnoreReason::UnknownType),
        }
    }
}

/// A `stored` event: its full blocks (each exactly `block_size` tokens) as one
/// [`EngineEvent::Stored`]; a shorter last block dropped and remembered. Blocks of another
/// size give an event of that size, which the agent drops as a block-size mismatch.
fn stored(
    block_size: usize,
    rank: &mut RankView,
    parent: Option<u64>,
    blocks: &[TrtllmBlock],
) -> TrtllmStep {
    if blocks.iter().any(|b| b.extra_keys) {
        return TrtllmStep::ignored(IgnoreReason::ExtraKeys);
    }
    if blocks.iter().any(|b| b.cache_level != 0) {
        return TrtllmStep::ignored(IgnoreReason::Medium);
    }
    let (full, partial) = match blocks.split_last() {
        Some((last, rest)) if last.token_ids.len() < block_size => (rest, Some(last)),
        _ => (blocks, None),
    };
    let mut out = TrtllmStep::default();
    if let Some(partial) = partial {
        rank.partial.insert(partial.block_hash);
        out.partial_blocks = 1;
    }
    let Some(first) = full.first() else {
        return out;
    };
    let size = full
        .iter()
        .map(|b| b.token_ids.len())
        .find(|&n| n != block_size)
        .unwrap_or(block_size);
    for block in full {
        rank.partial.remove(&block.block_hash);
    }
    out.event = Some(EngineEvent::Stored {
        block_hashes: full.iter().map(|b| b.block_hash).collect(),
        parent,
        token_ids: full
            .iter()
            .flat_map(|b| b.token_ids.iter().copied())
            .collect(),
        block_size: size,
        lora_name: None,
        mm_hashes: Vec::new(),
        cache_salt: first.cache_salt.clone().filter(|_| parent.is_none()),
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(hash: u64, first: u32, tokens: u32) -> TrtllmBlock {
        TrtllmBlock {
            block_hash: hash,
            token_ids: (first..first + tokens).collect(),
            extra_keys: false,
            cache_level: 0,
            cache_salt: None,
        }
    }

    fn event(event_id: u64, window: Option<u64>, data: TrtllmData) -> TrtllmEvent {
        TrtllmEvent {
            event_id,
            dp_rank: 0,
            window_size: window,
            data,
        }
    }

    #[test]
    fn hashes_read_as_integers_or_hex_strings() {
        assert_eq!(
            hash(&serde_json::json!(18446744073709551615_u64)),
            Ok(u64::MAX)
        );
        assert_eq!(hash(&serde_json::json!(-1)), Ok(u64::MAX));
        assert_eq!(hash(&serde_json::json!("0x0102")), Ok(0x0102));
        assert_eq!(
            hash(&serde_json::json!("00112233445566778899aabbccddeeff")),
            Ok(0x8899_aabb_ccdd_eeff),
            "the last 8 bytes, as byte-string hashes are folded"
        );
        assert_eq!(hash(&serde_json::json!("abc")), Ok(0x0abc));
        for bad in [
            serde_json::json!("xyz"),
            serde_json::json!(""),
            serde_json::json!(1.5),
        ] {
            assert!(hash(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn malformed_events_are_skipped_and_bad_answers_refused() {
        let body =
            br#"[{"event_id":0,"data":{"type":"created","num_blocks_per_cache_level":[8,0]}},
            {"event_id":1},{"data":{"type":"removed","block_hashes":[1]}},
            {"event_id":2,"data":{"type":"removed","block_hashes":[1]},"future_field":{"x":1}},
            {"event_id":3,"data":{"type":"novel"}}]"#;
        let poll = decode_trtllm_events(body).expect("an array");
        assert_eq!(poll.malformed_events, 2);
        assert_eq!(
            poll.malformed_reason.as_deref(),
            Some("an event without data")
        );
        let ids: Vec<u64> = poll.events.iter().map(|e| e.event_id).collect();
        assert_eq!(ids, [0, 2, 3]);
        assert_eq!(poll.events[2].data, TrtllmData::Unknown);
        for bad in [&b"{}"[..], b"[", b""] {
            assert!(decode_trtllm_events(bad).is_err());
        }
    }

    #[test]
    fn tokens_with_extra_ids_or_mm_keys_make_the_block_unreproducible() {
        let body = br#"[{"event_id":0,"data":{"type":"stored","parent_hash":null,"blocks":[
            {"type":"stored_block","block_hash":7,"tokens":[{"type":"unique_token","token_id":5,"token_extra_id":9}],"cache_level":0,"priority":35},
            {"type":"stored_block","block_hash":8,"tokens":[6],"mm_keys":[{"type":"mm_key","hash":"ab","start_offset":0}],"cache_salt":"s"}]}}]"#;
        let poll = decode_trtllm_events(body).expect("decodes");
        let TrtllmData::Stored { blocks, .. } = &poll.events[0].data else {
            panic!("{poll:?}");
        };
        assert!(blocks[0].extra_keys && blocks[1].extra_keys);
        assert_eq!(blocks[1].cache_salt.as_deref(), Some("s"));
        let mut view = TrtllmView::new(1);
        assert_eq!(
            view.translate(&poll.events[0]).event,
            Some(EngineEvent::Ignored(IgnoreReason::ExtraKeys))
        );
    }

    #[test]
    fn partial_blocks_are_dropped_and_their_removal_forgotten() {
        let mut view = TrtllmView::new(4);
        let stored = view.translate(&event(
            1,
            None,
            TrtllmData::Stored {
                parent: None,
                blocks: vec![block(10, 0, 4), block(11, 4, 2)],
            },
        ));
        assert_eq!(stored.partial_blocks, 1);
        assert_eq!(
            stored.event,
            Some(EngineEvent::Stored {
                block_hashes: vec![10],
                parent: None,
                token_ids: vec![0, 1, 2, 3],
                block_size: 4,
                lora_name: None,
                mm_hashes: Vec::new(),
                cache_salt: None,
            })
        );
        let removed = view.translate(&event(
            2,
            None,
            TrtllmData::Removed {
                block_hashes: vec![11, 10],
            },
        ));
        assert_eq!(
            removed.event,
            Some(EngineEvent::Removed {
                block_hashes: vec![10]
            })
        );
        let again = view.translate(&event(
            3,
            None,
            TrtllmData::Removed {
                block_hashes: vec![11],
            },
        ));
        assert_eq!(
            again.event,
            Some(EngineEvent::Removed {
                block_hashes: vec![11]
            }),
            "forgotten once removed: a second removal is the agent's miss"
        );
    }

    #[test]
    fn blocks_of_another_size_carry_it_and_a_host_block_is_ignored() {
        let mut view = TrtllmView::new(4);
        let odd = view.translate(&event(
            1,
            None,
            TrtllmData::Stored {
                parent: Some(3),
                blocks: vec![block(10, 0, 8), block(11, 8, 8)],
            },
        ));
        assert!(
            matches!(odd.event, Some(EngineEvent::Stored { block_size: 8, .. })),
            "{odd:?}"
        );
        let mut host = block(12, 0, 4);
        host.cache_level = 1;
        let host = view.translate(&event(
            2,
            None,
            TrtllmData::Stored {
                parent: None,
                blocks: vec![host],
            },
        ));
        assert_eq!(host.event, Some(EngineEvent::Ignored(IgnoreReason::Medium)));
    }

    #[test]
    fn a_created_after_blocks_clears_and_smaller_windows_are_skipped() {
        let mut view = TrtllmView::new(4);
        let created = |id, window, blocks| {
            event(
                id,
                Some(window),
                TrtllmData::Created {
                    blocks_per_cache_level: vec![blocks, 0],
                },
            )
        };
        assert_eq!(view.translate(&created(0, 512, 100)), TrtllmStep::default());
        assert_eq!(view.translate(&created(1, 4096, 50)), TrtllmStep::default());
        assert_eq!((view.window(), view.capacity()), (Some(4096), Some(50)));
        let small = event(
            2,
            Some(512),
            TrtllmData::Removed {
                block_hashes: vec![1],
            },
        );
        assert_eq!(
            view.translate(&small).event,
            Some(EngineEvent::Ignored(IgnoreReason::KvGroup))
        );
        let update = event(
            3,
            Some(4096),
            TrtllmData::Updated {
                block_hash: 1,
                cache_level: Some((0, 1)),
            },
        );
        assert_eq!(
            view.translate(&update).event,
            Some(EngineEvent::Ignored(IgnoreReason::Updated))
        );
        assert_eq!(
            view.translate(&created(4, 4096, 50)).event,
            Some(EngineEvent::Cleared),
            "a cache made again after blocks were seen"
        );
        assert_eq!(view.translate(&created(5, 4096, 50)).event, None);
        view.restart(0);
        assert_eq!(view.translate(&created(0, 4096, 50)).event, None);
    }
}

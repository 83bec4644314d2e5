//! Decoding an engine's KV event batch (wire-formats.md §1.5–§1.7 and §2): the outer batch as
//! a positional array of 2–3+ items or a map; each event as a legacy positional array or a map
//! with a `type` key (mixed batches allowed); hashes as ints (signed or unsigned) or byte
//! strings; unknown fields ignored. Events of other KV groups or media are kept as
//! [`EngineEvent::Ignored`] so they can be counted.

use kvmesh_kv::CacheTier;

use crate::msgpack::{DecodeError, Kind, Reader, Result, malformed};

/// Whose positional layout a batch's array-form events follow (map-form events name their
/// fields, the same for both). TensorRT-LLM publishes no such batches: its events are JSON
/// (see [`crate::decode_trtllm_events`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// vLLM's `BlockStored` / `BlockRemoved` fields (wire-formats.md §1.5–§1.7).
    Vllm,
    /// SGLang's (wire-formats.md §2).
    Sglang,
}

/// KV-cache spec kinds whose blocks kvmesh routes on; other kinds (sliding window, mamba, …)
/// are ignored.
const MAIN_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

/// Folds an engine's block hash into the agent's 64-bit id: an integer is bit-cast; a byte
/// string gives its **last 8 bytes read big-endian** (zero-padded on the left when shorter),
/// which is how vLLM turns its digests into integers, so both hash modes of one engine name a
/// block the same way.
pub fn fold_hash_bytes(bytes: &[u8]) -> u64 {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

/// The cache tier an event's `medium` names, whatever its case: vLLM 0.32 writes `GPU`,
/// `CPU` (its offloading connectors' host memory) and `STORAGE` (their disk and object
/// stores); LMCache and Mooncake write `cpu`, SGLang `CPU_PINNED`, Dynamo's block manager
/// `CPU_TIER1` and `CPU_TIER2` (host memory and disk). `None` for a medium not placed.
pub fn medium_tier(medium: &str) -> Option<CacheTier> {
    let medium = medium.to_ascii_uppercase();
    let names = |words: &[&str]| words.iter().any(|word| medium.contains(word));
    if matches!(medium.as_str(), "GPU" | "DEVICE" | "CUDA" | "HBM") {
        Some(CacheTier::Device)
    } else if names(&["STORAGE", "DISK", "SSD", "NVME", "TIER2"]) {
        Some(CacheTier::Disk)
    } else if names(&["CPU", "HOST", "CXL", "DRAM"]) {
        Some(CacheTier::Host)
    } else {
        None
    }
}

/// Why an event was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IgnoreReason {
    /// A KV-cache group other than the main one (hybrid models).
    KvGroup,
    /// A medium kvmesh does not place in a tier ([`medium_tier`]).
    Medium,
    /// A CPU-offload-style store without tokens or block size.
    Offload,
    /// An event type this agent does not know.
    UnknownType,
    /// TensorRT-LLM's `updated`: a block moved between cache levels or its priority changed
    /// (cache tiers are not tracked: the block stays as it was stored).
    Updated,
    /// TensorRT-LLM blocks whose key holds more than token ids (token extra ids, multimodal
    /// keys), which kvmesh cannot reproduce.
    ExtraKeys,
}

impl IgnoreReason {
    /// The `reason` label of `kvmesh_agent_dropped_total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::KvGroup => "kv_group",
            Self::Medium => "medium",
            Self::Offload => "offload",
            Self::UnknownType => "unknown_type",
            Self::Updated => "updated",
            Self::ExtraKeys => "extra_keys",
        }
    }
}

/// One engine KV event, decoded.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Blocks became cached.
    Stored {
        /// Engine ids of the blocks, parent first.
        block_hashes: Vec<u64>,
        /// Engine id of the block before the first one.
        parent: Option<u64>,
        /// All blocks' tokens concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block, as the engine says.
        block_size: usize,
        /// The LoRA adapter, when one produced the blocks.
        lora_name: Option<String>,
        /// Per block, the multimodal object hashes from `extra_keys` (empty when none).
        mm_hashes: Vec<Vec<u64>>,
        /// The request's `cache_salt`, only on an event that starts a sequence (no parent):
        /// vLLM's first block carries it in `extra_keys`, SGLang names it in `cache_salt`.
        /// It salts the first block's hash ([`kvmesh_kv::salted_local_hash`]).
        cache_salt: Option<String>,
    },
    /// Blocks were evicted.
    Removed {
        /// Engine ids of the blocks.
        block_hashes: Vec<u64>,
    },
    /// Blocks became cached in a lower tier (host memory, disk), named by the engine ids
    /// their device copies had: an offloading connector's store (vLLM's carries the same
    /// hashes as the device's events; its tokens, when it sends them, are not needed).
    TierStored {
        /// Where the blocks are kept.
        tier: CacheTier,
        /// Engine ids of the blocks.
        block_hashes: Vec<u64>,
    },
    /// Blocks left a lower tier.
    TierRemoved {
        /// The tier they left.
        tier: CacheTier,
        /// Engine ids of the blocks.
        block_hashes: Vec<u64>,
    },
    /// The whole cache was dropped.
    Cleared,
    /// An event deliberately not translated.
    Ignored(IgnoreReason),
}

/// One decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch {
    /// The engine's timestamp (seconds).
    pub ts: f64,
    /// The data-parallel rank the engine wrote, if any.
    pub dp_rank: Option<u32>,
    /// The events, in order.
    pub events: Vec<EngineEvent>,
    /// Events that could not be decoded (skipped; the rest of the batch is kept).
    pub malformed_events: usize,
    /// Why the first of them could not be (for the agent's log).
    pub malformed_reason: Option<String>,
}

/// Every field any event type may carry; filled by name or position.
#[derive(Default)]
struct Fields {
    tag: Option<String>,
    block_hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u64>,
    lora_name: Option<String>,
    medium: Option<String>,
    group_idx: Option<u64>,
    spec_kind: Option<String>,
    /// SGLang's `cache_salt` field.
    cache_salt: Option<String>,
    extra: ExtraKeys,
}

/// What `extra_keys` holds for kvmesh: per block the multimodal hashes, and the first block's
/// bare strings, which are resolved once the event's `lora_name` and parent are known
/// ([`ExtraKeys::resolve`]).
#[derive(Default)]
struct ExtraKeys {
    /// Per block (one entry per block once the field was read), the mm hashes found in
    /// `[identifier, offset]` pairs, and in bare strings of blocks after the first.
    mm_hashes: Vec<Vec<u64>>,
    /// The bare string items of the first block, with their positions in its list.
    first_block_strings: Vec<(usize, String)>,
}

impl ExtraKeys {
    /// The per-block mm hashes (empty when no block has one) and the cache salt.
    ///
    /// vLLM (`generate_block_hash_extra_keys`, published by `to_event_extra_keys`, checked
    /// against vLLM 0.33.0's wheel) lists a block's keys in the order LoRA name (a bare
    /// string, every block) + `[mm_identifier, offset]` pairs + `cache_salt` (a bare string,
    /// only the block at token 0) + prompt-embeds digests (bytes). So in the first block of an
    /// event without a parent, after a leading bare string equal to `lora_name`, the **last**
    /// bare string is the salt (whatever it looks like: a 64-hex salt is still a salt). Any
    /// other bare string is a multimodal hash if it is 64 hex digits (vLLM releases of early
    /// 2026 published bare mm identifiers), and ignored otherwise; after a parent the first
    /// block is not the request's first and carries no salt.
    fn resolve(mut self, lora_name: Option<&str>, root: bool) -> (Vec<Vec<u64>>, Option<String>) {
        let mut strings: Vec<String> = self
            .first_block_strings
            .into_iter()
            .filter(|(position, item)| !(*position == 0 && Some(item.as_str()) == lora_name))
            .map(|(_, item)| item)
            .collect();
        let salt = if root { strings.pop() } else { None };
        let first: Vec<u64> = strings.iter().filter_map(|item| mm_hash(item)).collect();
        if !first.is_empty()
            && let Some(block) = self.mm_hashes.first_mut()
        {
            block.extend(first);
        }
        if self.mm_hashes.iter().all(Vec::is_empty) {
            self.mm_hashes = Vec::new();
        }
        (self.mm_hashes, salt.filter(|s| !s.is_empty()))
    }
}

fn hash(r: &mut Reader<'_>) -> Result<u64> {
    match r.kind()? {
        Kind::Int => r.int(),
        Kind::Bin => {
            let bytes = r.bin()?;
            if bytes.is_empty() {
                return malformed("empty block hash");
            }
            Ok(fold_hash_bytes(bytes))
        }
        other => malformed(format!("block hash must be an int or bytes, not {other:?}")),
    }
}

fn optional_hash(r: &mut Reader<'_>) -> Result<Option<u64>> {
    if r.nil()? {
        return Ok(None);
    }
    hash(r).map(Some)
}

fn hashes(r: &mut Reader<'_>) -> Result<Vec<u64>> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(out)
}

fn tokens(r: &mut Reader<'_>) -> Result<Vec<u32>> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        if r.kind()? == Kind::Array {
            return malformed("token id pairs (speculative decoding) are not supported");
        }
        out.push(r.u32()?);
    }
    Ok(out)
}

fn optional_str(r: &mut Reader<'_>) -> Result<Option<String>> {
    match r.kind()? {
        Kind::Nil => {
            r.nil()?;
            Ok(None)
        }
        Kind::Str => Ok(Some(r.str()?.to_owned())),
        _ => {
            r.skip()?;
            Ok(None)
        }
    }
}

fn optional_int(r: &mut Reader<'_>) -> Result<Option<u64>> {
    match r.kind()? {
        Kind::Int => r.int().map(Some),
        _ => r.skip().map(|()| None),
    }
}

/// A multimodal hash from one `extra_keys` item: a 64-hex-digit string, whose first 16 digits
/// are the hash (kv-routing.md §1.4). Other items (LoRA names, salts) are not hashes.
fn mm_hash(item: &str) -> Option<u64> {
    if item.len() != 64 || !item.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(&item[..16], 16).ok()
}

/// SGLang's salt at `BlockStored` position 7: the `cache_salt` string itself, or a `metadata`
/// map with a `cache_salt` key (wire-formats.md §2); `None` for anything else.
fn metadata_salt(r: &mut Reader<'_>) -> Result<Option<String>> {
    if r.kind()? != Kind::Map {
        return optional_str(r);
    }
    let mut salt = None;
    let n = r.map_len()?;
    for _ in 0..n {
        let is_salt = if r.kind()? == Kind::Str {
            r.str()? == "cache_salt"
        } else {
            r.skip()?;
            false
        };
        if is_salt {
            salt = optional_str(r)?;
        } else {
            r.skip()?;
        }
    }
    Ok(salt)
}

/// One item of a block's `extra_keys` list.
#[derive(Debug, PartialEq)]
enum ExtraItem<'a> {
    /// A bare string: a LoRA name, a cache salt, or (early 2026 vLLM) a multimodal identifier.
    Str(&'a str),
    /// A multimodal hash from an `[mm_identifier, offset]` pair whose first element is a
    /// 64-hex string — the shape vLLM's `to_event_extra_keys` publishes (checked against vLLM
    /// 0.33.0's own encoder by `tests/engine_fixtures.rs`); the offset is not part of kvmesh's
    /// hash.
    Mm(u64),
    /// Anything else (prompt-embeds digests, pairs of other shapes).
    Other,
}

fn extra_key_item<'a>(r: &mut Reader<'a>) -> Result<ExtraItem<'a>> {
    match r.kind()? {
        Kind::Str => Ok(ExtraItem::Str(r.str()?)),
        Kind::Array => {
            let n = r.array_len()?;
            let mut found = None;
            for i in 0..n {
                if i == 0 && r.kind()? == Kind::Str {
                    found = mm_hash(r.str()?);
                } else {
                    r.skip()?;
                }
            }
            Ok(found.map_or(ExtraItem::Other, ExtraItem::Mm))
        }
        _ => r.skip().map(|()| ExtraItem::Other),
    }
}

/// `extra_keys`: per block nil or a list of items (see [`ExtraKeys`]).
fn extra_keys(r: &mut Reader<'_>) -> Result<ExtraKeys> {
    let mut out = ExtraKeys::default();
    if r.kind()? != Kind::Array {
        r.skip()?;
        return Ok(out);
    }
    let blocks = r.array_len()?;
    for index in 0..blocks {
        let mut block = Vec::new();
        if r.kind()? == Kind::Array {
            let items = r.array_len()?;
            for position in 0..items {
                match extra_key_item(r)? {
                    ExtraItem::Mm(h) => block.push(h),
                    ExtraItem::Str(item) if index == 0 => {
                        out.first_block_strings.push((position, item.to_owned()));
                    }
                    ExtraItem::Str(item) => block.extend(mm_hash(item)),
                    ExtraItem::Other => {}
                }
            }
        } else {
            r.skip()?;
        }
        out.mm_hashes.push(block);
    }
    Ok(out)
}

impl Fields {
    fn set_named(&mut self, key: &str, r: &mut Reader<'_>) -> Result<()> {
        match key {
            "type" => self.tag = Some(r.str()?.to_owned()),
            "block_hashes" => self.block_hashes = Some(hashes(r)?),
            "parent_block_hash" => self.parent = optional_hash(r)?,
            "token_ids" => self.token_ids = Some(tokens(r)?),
            "block_size" => self.block_size = optional_int(r)?,
            "lora_name" => self.lora_name = optional_str(r)?,
            "medium" => self.medium = optional_str(r)?,
            "group_idx" => self.group_idx = optional_int(r)?,
            "kv_cache_spec_kind" => self.spec_kind = optional_str(r)?,
            "extra_keys" => self.extra = extra_keys(r)?,
            "cache_salt" => self.cache_salt = optional_str(r)?,
            "metadata" => self.cache_salt = metadata_salt(r)?,
            _ => r.skip()?,
        }
        Ok(())
    }

    /// The name of positional field `pos` of event `tag` in `layout`, or `None` to skip it.
    fn positional_name(
        layout: Layout,
        tag: &str,
        pos: usize,
        r: &Reader<'_>,
    ) -> Result<Option<&'static str>> {
        Ok(match (tag, pos) {
            ("BlockStored", 1) | ("BlockRemoved", 1) => Some("block_hashes"),
            ("BlockStored", 2) => Some("parent_block_hash"),
            ("BlockStored", 3) => Some("token_ids"),
            ("BlockStored", 4) => Some("block_size"),
            ("BlockStored", 6) | ("BlockRemoved", 2) => Some("medium"),
            ("BlockStored", 7) if layout == Layout::Vllm => Some("lora_name"),
            ("BlockStored", 8) if layout == Layout::Vllm => Some("extra_keys"),
            // SGLang 0.5.23's `cache_salt` (a string); earlier a `metadata` map holding it.
            ("BlockStored", 7) if layout == Layout::Sglang => Some("metadata"),
            // Position 9 is group_idx in vLLM; some producers put other things there.
            ("BlockStored", 9) if layout == Layout::Vllm && r.kind()? == Kind::Int => {
                Some("group_idx")
            }
            ("BlockStored", 10) if layout == Layout::Vllm && r.kind()? == Kind::Str => {
                Some("kv_cache_spec_kind")
            }
            ("BlockRemoved", 3) if layout == Layout::Vllm => Some("group_idx"),
            _ => None,
        })
    }

    /// Where the event's blocks are kept, or why they are not tracked: a KV-cache group other
    /// than the main one, or a medium kvmesh does not know.
    fn placement(&self) -> std::result::Result<CacheTier, IgnoreReason> {
        let main_group = match &self.spec_kind {
            Some(kind) => MAIN_KINDS.contains(&kind.as_str()),
            None => self.group_idx.unwrap_or(0) == 0,
        };
        if !main_group {
            return Err(IgnoreReason::KvGroup);
        }
        match self.medium.as_deref() {
            None => Ok(CacheTier::Device),
            Some(medium) => medium_tier(medium).ok_or(IgnoreReason::Medium),
        }
    }

    fn into_event(self) -> Result<EngineEvent> {
        let placement = self.placement();
        let Some(tag) = self.tag else {
            return malformed("event without a type");
        };
        match tag.as_str() {
            "BlockStored" => {
                let Some(block_hashes) = self.block_hashes else {
                    return malformed("BlockStored without block_hashes");
                };
                match placement {
                    Err(reason) => return Ok(EngineEvent::Ignored(reason)),
                    Ok(CacheTier::Device) => {}
                    Ok(tier) => return Ok(EngineEvent::TierStored { tier, block_hashes }),
                }
                let token_ids = self.token_ids.unwrap_or_default();
                let block_size = self.block_size.unwrap_or(0) as usize;
                if block_size == 0 || token_ids.is_empty() {
                    return Ok(EngineEvent::Ignored(IgnoreReason::Offload));
                }
                let lora_name = self.lora_name.filter(|n| !n.is_empty());
                let root = self.parent.is_none();
                let (mm_hashes, extra_salt) = self.extra.resolve(lora_name.as_deref(), root);
                let named_salt = self.cache_salt.filter(|s| root && !s.is_empty());
                Ok(EngineEvent::Stored {
                    block_hashes,
                    parent: self.parent,
                    token_ids,
                    block_size,
                    lora_name,
                    mm_hashes,
                    cache_salt: named_salt.or(extra_salt),
                })
            }
            "BlockRemoved" => {
                let Some(block_hashes) = self.block_hashes else {
                    return malformed("BlockRemoved without block_hashes");
                };
                match placement {
                    Err(reason) => Ok(EngineEvent::Ignored(reason)),
                    Ok(CacheTier::Device) => Ok(EngineEvent::Removed { block_hashes }),
                    Ok(tier) => Ok(EngineEvent::TierRemoved { tier, block_hashes }),
                }
            }
            "AllBlocksCleared" => Ok(EngineEvent::Cleared),
            _ => Ok(EngineEvent::Ignored(IgnoreReason::UnknownType)),
        }
    }
}

fn event(layout: Layout, r: &mut Reader<'_>) -> Result<EngineEvent> {
    let mut fields = Fields::default();
    match r.kind()? {
        Kind::Map => {
            let n = r.map_len()?;
            for _ in 0..n {
                if r.kind()? != Kind::Str {
                    r.skip()?;
                    r.skip()?;
                    continue;
                }
                let key = r.str()?;
                fields.set_named(key, r)?;
            }
        }
        Kind::Array => {
            let n = r.array_len()?;
            if n == 0 {
                return malformed("empty event array");
            }
            let tag = r.str()?.to_owned();
            for pos in 1..n {
                match Fields::positional_name(layout, &tag, pos, r)? {
                    Some(name) => fields.set_named(name, r)?,
                    None => r.skip()?,
                }
            }
            fields.tag = Some(tag);
        }
        other => return malformed(format!("event must be an array or a map, not {other:?}")),
    }
    fields.into_event()
}

/// Decodes the events array into `batch`; an event that fails to decode is skipped and
/// counted, as long as the bytes can still be walked.
fn events(layout: Layout, r: &mut Reader<'_>, batch: &mut EngineBatch) -> Result<()> {
    let n = r.array_len()?;
    batch.events = Vec::with_capacity(n);
    batch.malformed_events = 0;
    batch.malformed_reason = None;
    for _ in 0..n {
        let start = r.position();
        match event(layout, r) {
            Ok(e) => batch.events.push(e),
            Err(DecodeError(why)) => {
                batch.malformed_events += 1;
                batch.malformed_reason.get_or_insert(why);
                r.seek(start);
                r.skip()?;
            }
        }
    }
    Ok(())
}

fn optional_rank(r: &mut Reader<'_>) -> Result<Option<u32>> {
    if r.nil()? {
        return Ok(None);
    }
    r.u32().map(Some)
}

/// Decodes one msgpack batch payload whose array-form events follow `layout`.
pub fn decode_batch(layout: Layout, payload: &[u8]) -> std::result::Result<EngineBatch, String> {
    decode(layout, payload).map_err(|e| e.0)
}

fn decode(layout: Layout, payload: &[u8]) -> Result<EngineBatch> {
    let mut r = Reader::new(payload);
    let mut batch = EngineBatch {
        ts: 0.0,
        dp_rank: None,
        events: Vec::new(),
        malformed_events: 0,
        malformed_reason: None,
    };
    let mut have_events = false;
    match r.kind()? {
        Kind::Array => {
            let n = r.array_len()?;
            if n < 2 {
                return malformed("batch array needs at least [ts, events]");
            }
            batch.ts = r.f64()?;
            events(layout, &mut r, &mut batch)?;
            have_events = true;
            if n > 2 {
                batch.dp_rank = optional_rank(&mut r)?;
            }
            for _ in 3..n {
                r.skip()?;
            }
        }
        Kind::Map => {
            let n = r.map_len()?;
            for _ in 0..n {
                if r.kind()? != Kind::Str {
                    r.skip()?;
                    r.skip()?;
                    continue;
                }
                match r.str()? {
                    "ts" => batch.ts = r.f64()?,
                    "events" => {
                        events(layout, &mut r, &mut batch)?;
                        have_events = true;
                    }
                    "data_parallel_rank" | "attn_dp_rank" => batch.dp_rank = optional_rank(&mut r)?,
                    _ => r.skip()?,
                }
            }
        }
        other => return malformed(format!("batch must be an array or a map, not {other:?}")),
    }
    if !have_events {
        return malformed("batch without events");
    }
    if r.remaining() != 0 {
        return malformed("trailing bytes after the batch");
    }
    Ok(batch)
}

#[cfg(test)]
mod tests;

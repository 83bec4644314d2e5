//! KV event batches as the agent takes them from an engine's ZMQ socket
//! (`kvmesh_engine_events::decode_batch`: vLLM's and SGLang's msgpack, positional arrays and
//! maps, integer and byte-string hashes).
//!
//! Input: one byte choosing the layout (vLLM's or SGLang's positional fields), then the
//! payload frame. Whatever it holds: nothing panics; a batch that decodes counts no more
//! events than it has bytes, and no shorter cut of it decodes (a frame cut short is refused);
//! every stored event has tokens and a block size, a salt only on a sequence's first block;
//! and the batch written back in the map form (which both layouts read alike), and for vLLM
//! in its positional form too, decodes to exactly itself.

#![no_main]

use kvmesh_engine_events::{
    EngineBatch, EngineEvent, IgnoreReason, Layout, decode_batch, fold_hash_bytes,
};
use kvmesh_kv::CacheTier;
use libfuzzer_sys::fuzz_target;

/// How a batch is written back.
#[derive(Clone, Copy, PartialEq)]
enum Form {
    /// `{ts, events, data_parallel_rank}`, every event a map with a `type`.
    Map,
    /// `[ts, events, rank]`, events as vLLM's positional arrays (ignored ones as maps).
    VllmPositional,
}

fn array(out: &mut Vec<u8>, len: usize) {
    rmp::encode::write_array_len(out, len as u32).expect("writes to a Vec");
}

fn map(out: &mut Vec<u8>, len: usize) {
    rmp::encode::write_map_len(out, len as u32).expect("writes to a Vec");
}

fn text(out: &mut Vec<u8>, value: &str) {
    rmp::encode::write_str(out, value).expect("writes to a Vec");
}

fn uint(out: &mut Vec<u8>, value: u64) {
    rmp::encode::write_uint(out, value).expect("writes to a Vec");
}

fn nil(out: &mut Vec<u8>) {
    rmp::encode::write_nil(out).expect("writes to a Vec");
}

fn optional_uint(out: &mut Vec<u8>, value: Option<u64>) {
    match value {
        Some(value) => uint(out, value),
        None => nil(out),
    }
}

fn optional_text(out: &mut Vec<u8>, value: Option<&str>) {
    match value {
        Some(value) => text(out, value),
        None => nil(out),
    }
}

fn uints(out: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    array(out, values.len());
    values.for_each(|value| uint(out, value));
}

/// A multimodal hash as vLLM names it in `extra_keys`: 64 hex digits, the first 16 the hash.
fn mm_identifier(hash: u64) -> String {
    format!("{hash:016x}{}", "0".repeat(48))
}

/// `extra_keys`: per block its multimodal hashes as `[identifier, offset]` pairs, with the
/// first block led by the LoRA name and ended by the salt, as vLLM lists them.
fn extra_keys(out: &mut Vec<u8>, mm_hashes: &[Vec<u64>], lora: Option<&str>, salt: Option<&str>) {
    array(out, mm_hashes.len().max(1));
    for index in 0..mm_hashes.len().max(1) {
        let hashes = mm_hashes.get(index).map_or(&[][..], Vec::as_slice);
        let (lora, salt) = if index == 0 {
            (lora, salt)
        } else {
            (None, None)
        };
        array(
            out,
            hashes.len() + usize::from(lora.is_some()) + usize::from(salt.is_some()),
        );
        if let Some(lora) = lora {
            text(out, lora);
        }
        for &hash in hashes {
            array(out, 2);
            text(out, &mm_identifier(hash));
            uint(out, 0);
        }
        if let Some(salt) = salt {
            text(out, salt);
        }
    }
}

/// An ignored event, as a map that decodes to the same reason.
fn ignored(out: &mut Vec<u8>, reason: IgnoreReason) {
    let (kind, fields) = match reason {
        IgnoreReason::KvGroup => ("BlockStored", 2),
        IgnoreReason::Medium => ("BlockRemoved", 2),
        IgnoreReason::Offload => ("BlockStored", 1),
        IgnoreReason::UnknownType => ("SomethingNew", 0),
        other => panic!("decode_batch ignored an event as {other:?} (TensorRT-LLM's reasons)"),
    };
    map(out, 1 + fields);
    text(out, "type");
    text(out, kind);
    if fields > 0 {
        text(out, "block_hashes");
        array(out, 0);
    }
    match reason {
        IgnoreReason::KvGroup => {
            text(out, "group_idx");
            uint(out, 1);
        }
        IgnoreReason::Medium => {
            text(out, "medium");
            text(out, "TAPE");
        }
        _ => {}
    }
}

fn event(out: &mut Vec<u8>, event: &EngineEvent, form: Form) {
    match (event, form) {
        (EngineEvent::Ignored(reason), _) => ignored(out, *reason),
        (EngineEvent::Cleared, Form::Map) => {
            map(out, 1);
            text(out, "type");
            text(out, "AllBlocksCleared");
        }
        (EngineEvent::Cleared, Form::VllmPositional) => {
            array(out, 1);
            text(out, "AllBlocksCleared");
        }
        // Lower tiers as maps in both forms, their medium as vLLM and SGLang name it.
        (EngineEvent::TierStored { tier, block_hashes }, _)
        | (EngineEvent::TierRemoved { tier, block_hashes }, _) => {
            let kind = match event {
                EngineEvent::TierStored { .. } => "BlockStored",
                _ => "BlockRemoved",
            };
            let medium = match tier {
                CacheTier::Host => "CPU_PINNED",
                CacheTier::Disk => "STORAGE",
                CacheTier::Device => panic!("a lower tier event in the device tier"),
            };
            map(out, 3);
            text(out, "type");
            text(out, kind);
            text(out, "block_hashes");
            uints(out, block_hashes.iter().copied());
            text(out, "medium");
            text(out, medium);
        }
        (EngineEvent::Removed { block_hashes }, Form::Map) => {
            map(out, 2);
            text(out, "type");
            text(out, "BlockRemoved");
            text(out, "block_hashes");
            uints(out, block_hashes.iter().copied());
        }
        (EngineEvent::Removed { block_hashes }, Form::VllmPositional) => {
            array(out, 2);
            text(out, "BlockRemoved");
            uints(out, block_hashes.iter().copied());
        }
        (
            EngineEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                mm_hashes,
                cache_salt,
            },
            Form::Map,
        ) => {
            map(out, 8);
            text(out, "type");
            text(out, "BlockStored");
            text(out, "block_hashes");
            uints(out, block_hashes.iter().copied());
            text(out, "parent_block_hash");
            optional_uint(out, *parent);
            text(out, "token_ids");
            uints(out, token_ids.iter().map(|&id| u64::from(id)));
            text(out, "block_size");
            uint(out, *block_size as u64);
            text(out, "lora_name");
            optional_text(out, lora_name.as_deref());
            text(out, "cache_salt");
            optional_text(out, cache_salt.as_deref());
            text(out, "extra_keys");
            extra_keys(out, mm_hashes, None, None);
        }
        (
            EngineEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                mm_hashes,
                cache_salt,
            },
            Form::VllmPositional,
        ) => {
            array(out, 9);
            text(out, "BlockStored");
            uints(out, block_hashes.iter().copied());
            optional_uint(out, *parent);
            uints(out, token_ids.iter().map(|&id| u64::from(id)));
            uint(out, *block_size as u64);
            nil(out); // lora_id
            nil(out); // medium
            optional_text(out, lora_name.as_deref());
            extra_keys(out, mm_hashes, lora_name.as_deref(), cache_salt.as_deref());
        }
    }
}

fn write(batch: &EngineBatch, form: Form) -> Vec<u8> {
    let mut out = Vec::new();
    let events = |out: &mut Vec<u8>| {
        array(out, batch.events.len());
        batch.events.iter().for_each(|e| event(out, e, form));
    };
    let rank = |out: &mut Vec<u8>| optional_uint(out, batch.dp_rank.map(u64::from));
    match form {
        Form::Map => {
            map(&mut out, 3);
            text(&mut out, "ts");
            rmp::encode::write_f64(&mut out, batch.ts).expect("writes to a Vec");
            text(&mut out, "events");
            events(&mut out);
            text(&mut out, "data_parallel_rank");
            rank(&mut out);
        }
        Form::VllmPositional => {
            array(&mut out, 3);
            rmp::encode::write_f64(&mut out, batch.ts).expect("writes to a Vec");
            events(&mut out);
            rank(&mut out);
        }
    }
    out
}

/// Decodes `bytes` written for `batch` and checks they read as exactly `batch`.
fn reads_back(layout: Layout, bytes: &[u8], batch: &EngineBatch, what: &str) {
    let again = decode_batch(layout, bytes).unwrap_or_else(|why| panic!("{what}: {why}"));
    assert_eq!(again.ts.to_bits(), batch.ts.to_bits(), "{what}: ts");
    assert_eq!(again.dp_rank, batch.dp_rank, "{what}: rank");
    assert_eq!(again.events, batch.events, "{what}: events");
    assert_eq!(
        (again.malformed_events, again.malformed_reason),
        (0, None),
        "{what}"
    );
}

/// A cut point in `0..len` that follows the bytes.
fn cut(data: &[u8]) -> usize {
    let hash = data.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    (hash % data.len().max(1) as u64) as usize
}

fuzz_target!(|data: &[u8]| {
    let Some((&choice, payload)) = data.split_first() else {
        return;
    };
    let mut tail = [0u8; 8];
    let last = &payload[payload.len().saturating_sub(8)..];
    tail[8 - last.len()..].copy_from_slice(last);
    assert_eq!(fold_hash_bytes(payload), u64::from_be_bytes(tail));

    let layout = if choice % 2 == 0 {
        Layout::Vllm
    } else {
        Layout::Sglang
    };
    let Ok(batch) = decode_batch(layout, payload) else {
        return;
    };
    assert!(batch.events.len() + batch.malformed_events <= payload.len());
    assert_eq!(batch.malformed_reason.is_some(), batch.malformed_events > 0);
    let shorter = cut(payload);
    assert!(
        decode_batch(layout, &payload[..shorter]).is_err(),
        "cut at {shorter} of {}",
        payload.len()
    );
    for event in &batch.events {
        if let EngineEvent::Stored {
            parent,
            token_ids,
            block_size,
            lora_name,
            cache_salt,
            ..
        } = event
        {
            assert!(*block_size > 0 && !token_ids.is_empty(), "{event:?}");
            assert!(lora_name.as_ref().is_none_or(|name| !name.is_empty()));
            assert!(
                cache_salt
                    .as_ref()
                    .is_none_or(|salt| parent.is_none() && !salt.is_empty()),
                "{event:?}"
            );
        }
    }
    let as_map = write(&batch, Form::Map);
    reads_back(Layout::Vllm, &as_map, &batch, "map form, vLLM");
    reads_back(Layout::Sglang, &as_map, &batch, "map form, SGLang");
    let positional = write(&batch, Form::VllmPositional);
    reads_back(Layout::Vllm, &positional, &batch, "vLLM's positional form");
});

//! The KV event decoder against bytes the real engines wrote: each fixture under
//! `tests/fixtures/` is a payload frame captured from vLLM's / SGLang's own
//! `ZmqEventPublisher` (their own msgspec classes and encoder, loaded from the released
//! wheels). `tests/fixtures/README.md` says which versions and how they were made; the values
//! asserted here are the ones `tests/fixtures/gen_engine_kv_events.py` put in.

use kvmesh_engine_events::{EngineBatch, EngineEvent, IgnoreReason, Layout, decode_batch};
use kvmesh_kv::CacheTier;
use rmpv::Value;

/// The `ts` every fixture batch carries.
const TS: f64 = 1_767_225_600.25;

// vLLM's integer block hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default): the low
// 64 bits of sha256("vllm-block-{i}"). Most are above i64::MAX, so msgspec writes uint64.
const V0: u64 = 0x871d_1f76_fffb_d8ed;
const V1: u64 = 0xe2ae_0560_8120_12e1;
const V2: u64 = 0x6a06_b5e6_f981_8b3b;
const V3: u64 = 0xfb1e_0e89_de67_bbf5;
const V4: u64 = 0xc5d6_8bcc_15c0_e931;
const V5: u64 = 0x447e_37b8_149e_1c03;
const V6: u64 = 0xa9c2_dc86_ed2b_f616;
const V8: u64 = 0x6a3c_5bb6_1d10_1cd6;
const V9: u64 = 0x8210_825d_0aba_80af;
const V10: u64 = 0x21e2_faf9_3d9a_bc58;
const V11: u64 = 0xf448_2d79_5a36_884d;
const V12: u64 = 0xb62a_a9d2_c871_1311;
const V13: u64 = 0xc1bf_54a5_4f6f_9111;
/// The fixture's 64-hex-digit salt: sha256("tenant-c").
const HEX_SALT: &str = "3c88b6c4e7210d1c63de91a2dbfcc1bc996449f690e416d3cca323871e42798e";
/// The first 16 hex digits of the multimodal identifier sha256("kvmesh fixture image").
const V_MM: u64 = 0xaca5_f289_e3c6_75ec;

// SGLang's page hashes: `hash_str_to_int64(sha256("sglang-page-{i}").hexdigest())`, signed
// int64 on the wire (negative ones as msgpack int64), bit-cast by the decoder.
const S0: u64 = -5_310_545_836_119_158_665_i64 as u64;
const S1: u64 = -1_693_241_326_392_152_638_i64 as u64;
const S2: u64 = 8_886_225_864_339_825_565;
const S5: u64 = -343_757_158_441_556_718_i64 as u64;
// Pages 3 and 4 namespaced for the LoRA adapter "sql-lora" (`namespaced_block_hash`).
const NS3: u64 = -5_646_705_205_887_388_469_i64 as u64;
const NS4: u64 = -8_134_143_065_197_072_760_i64 as u64;

const VLLM_STORED: &[u8] = include_bytes!("fixtures/vllm-0.33.0-block-stored.msgpack");
const VLLM_REMOVED: &[u8] = include_bytes!("fixtures/vllm-0.33.0-block-removed.msgpack");
const VLLM_CLEARED: &[u8] = include_bytes!("fixtures/vllm-0.33.0-all-blocks-cleared.msgpack");
const VLLM_MIXED: &[u8] = include_bytes!("fixtures/vllm-0.33.0-mixed-dp1.msgpack");
const VLLM_BYTES: &[u8] = include_bytes!("fixtures/vllm-0.33.0-bytes-hashes.msgpack");
const VLLM_SALT: &[u8] = include_bytes!("fixtures/vllm-0.33.0-cache-salt.msgpack");
const SGLANG_STORED: &[u8] = include_bytes!("fixtures/sglang-0.5.23-block-stored.msgpack");
const SGLANG_REMOVED: &[u8] = include_bytes!("fixtures/sglang-0.5.23-block-removed.msgpack");
const SGLANG_CLEARED: &[u8] = include_bytes!("fixtures/sglang-0.5.23-all-blocks-cleared.msgpack");
const SGLANG_MIXED: &[u8] = include_bytes!("fixtures/sglang-0.5.23-mixed-dp1.msgpack");

fn decode(layout: Layout, bytes: &[u8]) -> EngineBatch {
    let batch = decode_batch(layout, bytes).expect("a real engine's batch decodes");
    assert_eq!(batch.ts, TS);
    assert_eq!(batch.malformed_events, 0);
    batch
}

fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, token_ids: Vec<u32>) -> EngineEvent {
    EngineEvent::Stored {
        block_hashes: hashes.to_vec(),
        parent,
        token_ids,
        block_size: 16,
        lora_name: None,
        mm_hashes: vec![],
        cache_salt: None,
    }
}

fn with_lora(event: EngineEvent, name: &str) -> EngineEvent {
    match event {
        EngineEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            mm_hashes,
            cache_salt,
            ..
        } => EngineEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_name: Some(name.to_owned()),
            mm_hashes,
            cache_salt,
        },
        other => other,
    }
}

fn with_salt(event: EngineEvent, salt: &str) -> EngineEvent {
    match event {
        EngineEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
            mm_hashes,
            ..
        } => EngineEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_name,
            mm_hashes,
            cache_salt: Some(salt.to_owned()),
        },
        other => other,
    }
}

fn removed(hashes: &[u64]) -> EngineEvent {
    EngineEvent::Removed {
        block_hashes: hashes.to_vec(),
    }
}

#[test]
fn vllm_block_stored() {
    let b = decode(Layout::Vllm, VLLM_STORED);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(
        b.events,
        vec![
            stored(&[V0, V1, V2], None, tokens(1000, 48)),
            // lora_id 1 is on the wire too (deprecated there); the agent keys LoRA by name.
            // Its extra_keys are [["sql-lora"], ["sql-lora"]]: no multimodal hash.
            with_lora(stored(&[V3, V4], Some(V2), tokens(2000, 32)), "sql-lora"),
            // extra_keys [[[identifier, 3]]]: vLLM publishes (mm_identifier, offset) pairs.
            EngineEvent::Stored {
                block_hashes: vec![V5],
                parent: None,
                token_ids: tokens(3000, 16),
                block_size: 16,
                lora_name: None,
                mm_hashes: vec![vec![V_MM]],
                cache_salt: None,
            },
        ]
    );
}

/// Extra keys made by vLLM's own `generate_block_hash_extra_keys` for requests with a
/// `cache_salt`, published through `to_event_extra_keys`: the salt is a bare string in the
/// first block's list only, after the LoRA name.
#[test]
fn vllm_cache_salt() {
    let b = decode(Layout::Vllm, VLLM_SALT);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(
        b.events,
        vec![
            // extra_keys [["tenant-a"], nil].
            with_salt(stored(&[V8, V9], None, tokens(5000, 32)), "tenant-a"),
            // extra_keys [nil]: a continuation carries no salt (its parent's hash does).
            stored(&[V10], Some(V9), tokens(5032, 16)),
            // extra_keys [["sql-lora", "tenant-b"], ["sql-lora"]].
            with_salt(
                with_lora(stored(&[V11, V12], None, tokens(5000, 32)), "sql-lora"),
                "tenant-b"
            ),
            // extra_keys [[sha256("tenant-c") hex]]: a salt, not a multimodal hash.
            with_salt(stored(&[V13], None, tokens(5000, 16)), HEX_SALT),
        ]
    );
}

#[test]
fn vllm_block_removed() {
    let b = decode(Layout::Vllm, VLLM_REMOVED);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.events, vec![removed(&[V3]), removed(&[V4])]);
}

#[test]
fn vllm_all_blocks_cleared() {
    let b = decode(Layout::Vllm, VLLM_CLEARED);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.events, vec![EngineEvent::Cleared]);
}

#[test]
fn vllm_mixed_batch_of_rank_1() {
    let b = decode(Layout::Vllm, VLLM_MIXED);
    assert_eq!(b.dp_rank, Some(1));
    assert_eq!(
        b.events,
        vec![
            stored(&[V6], None, tokens(4000, 16)),
            // group_idx 1, kv_cache_spec_kind "sliding_window".
            EngineEvent::Ignored(IgnoreReason::KvGroup),
            // medium "CPU" (the CPU offloading connector's store): kept in the host tier.
            EngineEvent::TierStored {
                tier: CacheTier::Host,
                block_hashes: vec![V6],
            },
            removed(&[V6]),
            EngineEvent::Cleared,
        ]
    );
}

/// With `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` vLLM sends the 32-byte sha256 digests; the
/// decoder folds them to the same ids as the integer mode.
#[test]
fn vllm_byte_hashes_fold_to_the_integer_mode_ids() {
    let b = decode(Layout::Vllm, VLLM_BYTES);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(
        b.events,
        vec![stored(&[V0, V1, V2], None, tokens(1000, 48))]
    );
    assert_eq!(
        b.events[0],
        decode(Layout::Vllm, VLLM_STORED).events[0],
        "both hash modes name the blocks alike"
    );
}

#[test]
fn sglang_block_stored() {
    let b = decode(Layout::Sglang, SGLANG_STORED);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(
        b.events,
        vec![
            stored(&[S0], None, tokens(1000, 16)),
            stored(&[S1], Some(S0), tokens(1016, 16)),
            stored(&[S2], Some(S1), tokens(1032, 16)),
            with_lora(stored(&[NS3], None, tokens(2000, 16)), "sql-lora"),
            with_lora(stored(&[NS4], Some(NS3), tokens(2016, 16)), "sql-lora"),
        ]
    );
}

#[test]
fn sglang_block_removed() {
    let b = decode(Layout::Sglang, SGLANG_REMOVED);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.events, vec![removed(&[S1, S2])]);
}

#[test]
fn sglang_all_blocks_cleared() {
    let b = decode(Layout::Sglang, SGLANG_CLEARED);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.events, vec![EngineEvent::Cleared]);
}

#[test]
fn sglang_mixed_batch_of_attention_dp_rank_1() {
    let b = decode(Layout::Sglang, SGLANG_MIXED);
    assert_eq!(b.dp_rank, Some(1));
    assert_eq!(
        b.events,
        vec![
            stored(&[S5], None, tokens(5000, 16)),
            // medium "CPU_PINNED" (the host / L2 tier): a store and a removal.
            EngineEvent::TierStored {
                tier: CacheTier::Host,
                block_hashes: vec![S5],
            },
            EngineEvent::TierRemoved {
                tier: CacheTier::Host,
                block_hashes: vec![S5],
            },
            removed(&[S5]),
            EngineEvent::Cleared,
        ]
    );
}

/// The wire shape itself, read with a generic msgpack reader, so a change of format in a
/// regenerated fixture shows up as such: the batch is a positional `[ts, events, rank]`
/// array, every event a map whose first key is `type`.
#[test]
fn wire_shape_is_a_positional_batch_of_tagged_maps() {
    let all: [(&str, &[u8]); 10] = [
        ("vllm stored", VLLM_STORED),
        ("vllm removed", VLLM_REMOVED),
        ("vllm cleared", VLLM_CLEARED),
        ("vllm mixed", VLLM_MIXED),
        ("vllm bytes", VLLM_BYTES),
        ("vllm salt", VLLM_SALT),
        ("sglang stored", SGLANG_STORED),
        ("sglang removed", SGLANG_REMOVED),
        ("sglang cleared", SGLANG_CLEARED),
        ("sglang mixed", SGLANG_MIXED),
    ];
    for (name, mut bytes) in all {
        let v = rmpv::decode::read_value(&mut bytes).expect("msgpack");
        assert!(bytes.is_empty(), "{name}: trailing bytes");
        let Value::Array(batch) = v else {
            panic!("{name}: batch is not an array")
        };
        assert_eq!(batch.len(), 3, "{name}: [ts, events, rank]");
        assert_eq!(batch[0].as_f64(), Some(TS), "{name}: ts");
        let events = batch[1].as_array().expect("events array");
        for e in events {
            let map = e.as_map().expect("events are maps");
            assert_eq!(map[0].0.as_str(), Some("type"), "{name}: type first");
        }
    }

    // vLLM's deprecated lora_id is on the wire beside lora_name.
    let v = rmpv::decode::read_value(&mut &VLLM_STORED[..]).expect("msgpack");
    let lora_event = v
        .as_array()
        .and_then(|batch| batch[1].as_array())
        .and_then(|events| events[1].as_map())
        .expect("the second event is a map");
    let field = |k: &str| lora_event.iter().find(|(key, _)| key.as_str() == Some(k));
    assert_eq!(field("lora_id").map(|(_, v)| v.as_u64()), Some(Some(1)));
    assert_eq!(
        field("lora_name").map(|(_, v)| v.as_str()),
        Some(Some("sql-lora"))
    );
}

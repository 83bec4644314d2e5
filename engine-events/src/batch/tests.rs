use rmpv::Value;

use super::*;

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = rmpv::encode::write_value(&mut out, v);
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn ints(xs: &[u64]) -> Value {
    Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&Value::Array(vec![
        Value::F64(1.5),
        Value::Array(events),
        Value::from(0),
    ]))
}

fn stored_positional(hashes: Value, parent: Value, tokens: &[u64], extra: Vec<Value>) -> Value {
    let mut v = vec![
        s("BlockStored"),
        hashes,
        parent,
        ints(tokens),
        Value::from(2),
    ];
    v.extend(extra);
    Value::Array(v)
}

fn decode_ok(layout: Layout, bytes: &[u8]) -> EngineBatch {
    decode_batch(layout, bytes).expect("decodes")
}

#[test]
fn legacy_positional_events_of_every_length() {
    // Minimal (5 fields), with lora_id + medium + lora_name (8), and with every later field.
    let short = stored_positional(ints(&[1, 2]), Value::Nil, &[1, 2, 3, 4], vec![]);
    let eight = stored_positional(
        ints(&[3]),
        Value::from(2),
        &[5, 6],
        vec![Value::Nil, s("GPU"), s("adapter")],
    );
    let twelve = stored_positional(
        ints(&[4]),
        Value::from(3),
        &[7, 8],
        vec![
            Value::Nil,
            s("GPU"),
            Value::Nil,
            Value::Array(vec![Value::Nil]),
            Value::from(0),
            s("full_attention"),
            Value::Nil,
            s("ignored extra position"),
        ],
    );
    let removed = Value::Array(vec![
        s("BlockRemoved"),
        ints(&[1]),
        s("GPU"),
        Value::from(0),
    ]);
    let cleared = Value::Array(vec![s("AllBlocksCleared")]);
    let b = decode_ok(
        Layout::Vllm,
        &batch(vec![short, eight, twelve, removed, cleared]),
    );
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(b.malformed_events, 0);
    assert_eq!(
        b.events[0],
        EngineEvent::Stored {
            block_hashes: vec![1, 2],
            parent: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            lora_name: None,
            mm_hashes: vec![],
            cache_salt: None,
        }
    );
    assert!(
        matches!(&b.events[1], EngineEvent::Stored { parent: Some(2), lora_name: Some(l), .. } if l == "adapter")
    );
    assert!(
        matches!(&b.events[2], EngineEvent::Stored { block_hashes, .. } if block_hashes == &[4])
    );
    assert_eq!(
        b.events[3],
        EngineEvent::Removed {
            block_hashes: vec![1]
        }
    );
    assert_eq!(b.events[4], EngineEvent::Cleared);
}

#[test]
fn map_events_decode_by_name_in_any_order() {
    let stored = map(vec![
        ("token_ids", ints(&[1, 2])),
        ("future_field", Value::Array(vec![Value::from(1)])),
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[9])),
        ("parent_block_hash", Value::Nil),
        ("block_size", Value::from(2)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("lora_name", Value::Nil),
        ("extra_keys", Value::Array(vec![Value::Nil])),
        ("group_idx", Value::from(0)),
        ("kv_cache_spec_kind", s("full_attention")),
    ]);
    let removed = map(vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", ints(&[9])),
    ]);
    // A mixed batch: a map event next to a positional one.
    let positional = Value::Array(vec![s("AllBlocksCleared")]);
    let b = decode_ok(Layout::Vllm, &batch(vec![stored, removed, positional]));
    assert!(
        matches!(&b.events[0], EngineEvent::Stored { block_hashes, token_ids, .. } if block_hashes == &[9] && token_ids == &[1, 2])
    );
    assert_eq!(
        b.events[1],
        EngineEvent::Removed {
            block_hashes: vec![9]
        }
    );
    assert_eq!(b.events[2], EngineEvent::Cleared);
}

#[test]
fn outer_batch_forms() {
    let ev = Value::Array(vec![s("AllBlocksCleared")]);
    let two = encode(&Value::Array(vec![
        Value::F64(2.0),
        Value::Array(vec![ev.clone()]),
    ]));
    let b = decode_ok(Layout::Vllm, &two);
    assert_eq!((b.dp_rank, b.events.len()), (None, 1));
    let nil_rank = encode(&Value::Array(vec![
        Value::F64(2.0),
        Value::Array(vec![]),
        Value::Nil,
    ]));
    assert_eq!(decode_ok(Layout::Vllm, &nil_rank).dp_rank, None);
    let as_map = encode(&map(vec![
        ("ts", Value::F32(3.0)),
        ("events", Value::Array(vec![ev])),
        ("data_parallel_rank", Value::from(2)),
    ]));
    let b = decode_ok(Layout::Vllm, &as_map);
    assert_eq!((b.ts, b.dp_rank, b.events.len()), (3.0, Some(2), 1));
    let int_ts = encode(&Value::Array(vec![Value::from(7), Value::Array(vec![])]));
    assert_eq!(decode_ok(Layout::Vllm, &int_ts).ts, 7.0);
}

#[test]
fn hashes_as_signed_ints_and_byte_strings() {
    let mut digest = [0u8; 32];
    digest[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    let hashes = Value::Array(vec![
        Value::from(-1i64),
        Value::Binary(digest.to_vec()),
        Value::Binary(vec![0xAB]),
    ]);
    let ev = stored_positional(hashes, Value::Binary(digest.to_vec()), &[0; 6], vec![]);
    let b = decode_ok(Layout::Vllm, &batch(vec![ev]));
    let EngineEvent::Stored {
        block_hashes,
        parent,
        ..
    } = &b.events[0]
    else {
        panic!("not stored: {:?}", b.events[0]);
    };
    assert_eq!(block_hashes, &vec![u64::MAX, 0x0102_0304_0506_0708, 0xAB]);
    assert_eq!(*parent, Some(0x0102_0304_0506_0708));
    assert_eq!(fold_hash_bytes(&digest), 0x0102_0304_0506_0708);
}

#[test]
fn other_groups_unknown_media_and_offload_stores_are_ignored_and_lower_tiers_kept() {
    let sliding = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1])),
        ("token_ids", ints(&[1, 2])),
        ("block_size", Value::from(2)),
        ("group_idx", Value::from(0)),
        ("kv_cache_spec_kind", s("sliding_window")),
    ]);
    let group1 = stored_positional(
        ints(&[1]),
        Value::Nil,
        &[1, 2],
        vec![Value::Nil, s("GPU"), Value::Nil, Value::Nil, Value::from(1)],
    );
    let cpu = stored_positional(ints(&[1]), Value::Nil, &[1, 2], vec![Value::Nil, s("CPU")]);
    let offload = Value::Array(vec![
        s("BlockStored"),
        ints(&[1]),
        Value::Nil,
        ints(&[]),
        Value::from(0),
    ]);
    let removed_group = Value::Array(vec![
        s("BlockRemoved"),
        ints(&[1]),
        s("GPU"),
        Value::from(2),
    ]);
    let removed_cpu = map(vec![
        ("type", s("BlockRemoved")),
        ("block_hashes", ints(&[1])),
        ("medium", s("CPU_TIER2")),
    ]);
    let mla = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1])),
        ("token_ids", ints(&[1, 2])),
        ("block_size", Value::from(2)),
        ("group_idx", Value::from(3)),
        ("kv_cache_spec_kind", s("mla_attention")),
    ]);
    let unknown = Value::Array(vec![s("BlockMoved")]);
    let tape = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1])),
        ("medium", s("TAPE")),
    ]);
    let b = decode_ok(
        Layout::Vllm,
        &batch(vec![
            sliding,
            group1,
            cpu,
            offload,
            removed_group,
            removed_cpu,
            mla,
            unknown,
            tape,
        ]),
    );
    let reasons: Vec<_> = b
        .events
        .iter()
        .map(|e| match e {
            EngineEvent::Ignored(r) => Some(*r),
            _ => None,
        })
        .collect();
    assert_eq!(
        reasons,
        vec![
            Some(IgnoreReason::KvGroup),
            Some(IgnoreReason::KvGroup),
            None,
            Some(IgnoreReason::Offload),
            Some(IgnoreReason::KvGroup),
            None,
            None,
            Some(IgnoreReason::UnknownType),
            Some(IgnoreReason::Medium),
        ]
    );
    // Lower tiers are kept, by the engine's ids.
    assert_eq!(
        b.events[2],
        EngineEvent::TierStored {
            tier: CacheTier::Host,
            block_hashes: vec![1]
        }
    );
    assert_eq!(
        b.events[5],
        EngineEvent::TierRemoved {
            tier: CacheTier::Disk,
            block_hashes: vec![1]
        }
    );
}

#[test]
fn sglang_position_seven_is_metadata_not_a_lora_name() {
    let ev = stored_positional(
        ints(&[1]),
        Value::Nil,
        &[1, 2],
        vec![Value::Nil, s("GPU"), map(vec![("cache_salt", s("x"))])],
    );
    let b = decode_ok(Layout::Sglang, &batch(vec![ev.clone()]));
    assert!(matches!(
        &b.events[0],
        EngineEvent::Stored {
            lora_name: None,
            ..
        }
    ));
    assert!(
        matches!(&b.events[0], EngineEvent::Stored { cache_salt: Some(salt), .. } if salt == "x"),
        "the metadata map's cache_salt salts the root page"
    );
    // The same bytes read as vLLM: position 7 is not a string, so no LoRA either, and vLLM's
    // salt is never read from there.
    let b = decode_ok(Layout::Vllm, &batch(vec![ev]));
    assert!(matches!(
        &b.events[0],
        EngineEvent::Stored {
            lora_name: None,
            cache_salt: None,
            ..
        }
    ));
    let sglang_removed = Value::Array(vec![s("BlockRemoved"), ints(&[5])]);
    let b = decode_ok(Layout::Sglang, &batch(vec![sglang_removed]));
    assert_eq!(
        b.events[0],
        EngineEvent::Removed {
            block_hashes: vec![5]
        }
    );
}

#[test]
fn multimodal_extra_keys_become_mm_hashes() {
    let hex = format!("{:016x}{}", 0xfeed_u64, "0".repeat(48));
    let extra = Value::Array(vec![
        Value::Nil,
        Value::Array(vec![s(&hex), s("my-lora"), Value::from(3)]),
    ]);
    let ev = stored_positional(
        ints(&[1, 2]),
        Value::Nil,
        &[1, 2, 3, 4],
        vec![Value::Nil, s("GPU"), Value::Nil, extra],
    );
    let b = decode_ok(Layout::Vllm, &batch(vec![ev]));
    assert!(
        matches!(&b.events[0], EngineEvent::Stored { mm_hashes, .. } if mm_hashes == &vec![vec![], vec![0xfeed]])
    );
}

#[test]
fn malformed_events_are_skipped_and_messages_rejected() {
    let bad_event = Value::Array(vec![
        s("BlockStored"),
        s("not hashes"),
        Value::Nil,
        ints(&[]),
        Value::from(2),
    ]);
    let bigrams = Value::Array(vec![
        s("BlockStored"),
        ints(&[1]),
        Value::Nil,
        Value::Array(vec![ints(&[1, 2])]),
        Value::from(1),
    ]);
    let good = Value::Array(vec![s("AllBlocksCleared")]);
    let b = decode_ok(
        Layout::Vllm,
        &batch(vec![bad_event, Value::from(5), bigrams, good]),
    );
    assert_eq!(b.malformed_events, 3);
    assert_eq!(
        b.malformed_reason.as_deref(),
        Some("expected an array, found FixStr(10)"),
        "the first one's reason"
    );
    assert_eq!(b.events, vec![EngineEvent::Cleared]);

    let garbage: Vec<Vec<u8>> = vec![
        vec![],
        b"not msgpack at all".to_vec(),
        vec![0xc1],
        encode(&Value::Array(vec![Value::F64(1.0)])),
        encode(&map(vec![("ts", Value::F64(1.0))])),
        encode(&s("string batch")),
        {
            let mut v = batch(vec![]);
            v.push(0);
            v
        },
        batch(vec![Value::Array(vec![s("AllBlocksCleared")])])[..5].to_vec(),
    ];
    for g in garbage {
        assert!(decode_batch(Layout::Vllm, &g).is_err(), "{g:?} accepted");
    }
}

#[test]
fn random_bytes_never_panic() {
    // A deterministic xorshift stream of junk, and valid messages with bytes flipped.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let valid = batch(vec![
        stored_positional(
            ints(&[1, 2]),
            Value::Nil,
            &[1, 2, 3, 4],
            vec![Value::Nil, s("GPU")],
        ),
        map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", ints(&[1])),
        ]),
    ]);
    for i in 0..5_000 {
        let bytes: Vec<u8> = if i % 2 == 0 {
            (0..(next() % 64)).map(|_| next() as u8).collect()
        } else {
            let mut v = valid.clone();
            let at = (next() as usize) % v.len();
            v[at] = next() as u8;
            v
        };
        let _ = decode_batch(Layout::Vllm, &bytes);
        let _ = decode_batch(Layout::Sglang, &bytes);
    }
}

/// A vLLM map-form `BlockStored` (the shape of vLLM 0.26+, as `to_event_extra_keys` fills
/// `extra_keys`) with `block_hashes.len()` blocks of 2 tokens.
fn vllm_stored(hashes: &[u64], parent: Option<u64>, lora: Option<&str>, extra: Value) -> Value {
    let tokens: Vec<u64> = (0..hashes.len() as u64 * 2).collect();
    map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(hashes)),
        ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
        ("token_ids", ints(&tokens)),
        ("block_size", Value::from(2)),
        ("lora_id", lora.map_or(Value::Nil, |_| Value::from(1))),
        ("medium", s("GPU")),
        ("lora_name", lora.map_or(Value::Nil, s)),
        ("extra_keys", extra),
        ("group_idx", Value::from(0)),
        ("kv_cache_spec_kind", s("full_attention")),
    ])
}

fn keys(blocks: Vec<Option<Vec<Value>>>) -> Value {
    Value::Array(
        blocks
            .into_iter()
            .map(|b| b.map_or(Value::Nil, Value::Array))
            .collect(),
    )
}

/// `(cache_salt, lora_name, mm_hashes)` of each decoded Stored event.
type Salted = (Option<String>, Option<String>, Vec<Vec<u64>>);

fn salts(events: Vec<Value>) -> Vec<Salted> {
    decode_ok(Layout::Vllm, &batch(events))
        .events
        .into_iter()
        .map(|e| match e {
            EngineEvent::Stored {
                cache_salt,
                lora_name,
                mm_hashes,
                ..
            } => (cache_salt, lora_name, mm_hashes),
            other => panic!("not a Stored event: {other:?}"),
        })
        .collect()
}

#[test]
fn vllm_cache_salt_is_the_root_blocks_last_bare_string() {
    let hex = format!("{:016x}{}", 0xfeed_u64, "0".repeat(48));
    let hex_salt = "ab".repeat(32);
    let got = salts(vec![
        // A salted text prompt: [("tenant-a",), None].
        vllm_stored(
            &[1, 2],
            None,
            None,
            keys(vec![Some(vec![s("tenant-a")]), None]),
        ),
        // An adapter's salted prompt: the LoRA name comes first, on every block.
        vllm_stored(
            &[3, 4],
            None,
            Some("sql-lora"),
            keys(vec![
                Some(vec![s("sql-lora"), s("tenant-a")]),
                Some(vec![s("sql-lora")]),
            ]),
        ),
        // The adapter alone: no salt.
        vllm_stored(&[5], None, Some("x"), keys(vec![Some(vec![s("x")])])),
        // A salt spelled like the adapter is still a salt.
        vllm_stored(
            &[6],
            None,
            Some("x"),
            keys(vec![Some(vec![s("x"), s("x")])]),
        ),
        // Multimodal pair + salt + prompt-embeds digest, in vLLM's order.
        vllm_stored(
            &[7],
            None,
            None,
            keys(vec![Some(vec![
                Value::Array(vec![s(&hex), Value::from(0)]),
                s("tenant-b"),
                Value::Binary(vec![7; 32]),
            ])]),
        ),
        // A salt of 64 hex digits (a sha256 of the tenant) is the salt, not an mm hash.
        vllm_stored(&[8], None, None, keys(vec![Some(vec![s(&hex_salt)])])),
        // An empty salt is no salt (vLLM rejects it).
        vllm_stored(&[9], None, None, keys(vec![Some(vec![s("")])])),
    ]);
    let salt = |x: &str| Some(x.to_owned());
    assert_eq!(
        got,
        vec![
            (salt("tenant-a"), None, vec![]),
            (salt("tenant-a"), salt("sql-lora"), vec![]),
            (None, salt("x"), vec![]),
            (salt("x"), salt("x"), vec![]),
            (salt("tenant-b"), None, vec![vec![0xfeed]]),
            (Some(hex_salt.clone()), None, vec![]),
            (None, None, vec![]),
        ]
    );
}

#[test]
fn events_after_a_parent_carry_no_salt() {
    let hex = format!("{:016x}{}", 0xbeef_u64, "0".repeat(48));
    let got = salts(vec![
        // vLLM never salts a continuation; a bare string there is not taken for one.
        vllm_stored(&[2], Some(1), None, keys(vec![Some(vec![s("tenant-a")])])),
        // Early-2026 vLLM's bare mm identifiers still count as mm hashes there.
        vllm_stored(&[3], Some(2), None, keys(vec![Some(vec![s(&hex)])])),
        // A root event's earlier bare hex strings are mm hashes, the last one the salt.
        vllm_stored(
            &[4, 5],
            None,
            None,
            keys(vec![
                Some(vec![s(&hex), s("tenant-a")]),
                Some(vec![s(&hex)]),
            ]),
        ),
    ]);
    assert_eq!(
        got,
        vec![
            (None, None, vec![]),
            (None, None, vec![vec![0xbeef]]),
            (
                Some("tenant-a".to_owned()),
                None,
                vec![vec![0xbeef], vec![0xbeef]]
            ),
        ]
    );
}

#[test]
fn sglang_cache_salt_field_salts_root_pages() {
    let page = |hash: u64, parent: Option<u64>, salt: Value| {
        map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[hash])),
            ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
            ("token_ids", ints(&[1, 2])),
            ("block_size", Value::from(2)),
            ("lora_id", Value::Nil),
            ("medium", s("GPU")),
            ("cache_salt", salt),
            ("session_id", Value::Nil),
            ("lora_name", Value::Nil),
        ])
    };
    let positional = stored_positional(
        ints(&[3]),
        Value::Nil,
        &[1, 2],
        vec![Value::Nil, s("GPU"), s("tenant-c")],
    );
    let b = decode_ok(
        Layout::Sglang,
        &batch(vec![
            page(1, None, s("tenant-a")),
            page(2, Some(1), s("tenant-a")),
            page(5, None, Value::Nil),
            positional,
        ]),
    );
    let got: Vec<Option<String>> = b
        .events
        .into_iter()
        .map(|e| match e {
            EngineEvent::Stored { cache_salt, .. } => cache_salt,
            other => panic!("not a Stored event: {other:?}"),
        })
        .collect();
    assert_eq!(
        got,
        vec![
            Some("tenant-a".to_owned()),
            None,
            None,
            Some("tenant-c".to_owned())
        ]
    );
}

#[test]
fn media_name_their_tier_whatever_their_case() {
    for (medium, tier) in [
        ("GPU", Some(CacheTier::Device)),
        ("gpu", Some(CacheTier::Device)),
        ("CPU", Some(CacheTier::Host)),
        ("cpu", Some(CacheTier::Host)),
        ("CPU_PINNED", Some(CacheTier::Host)),
        ("CXL", Some(CacheTier::Host)),
        ("CPU_TIER1", Some(CacheTier::Host)),
        ("CPU_TIER2", Some(CacheTier::Disk)),
        ("STORAGE", Some(CacheTier::Disk)),
        ("disk", Some(CacheTier::Disk)),
        ("TAPE", None),
        ("", None),
    ] {
        assert_eq!(medium_tier(medium), tier, "{medium}");
    }
}

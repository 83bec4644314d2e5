//! The KV event decoder against frames a RUNNING vLLM 0.32.0 published (the CPU
//! build `scripts/vllm.sh` installs, driven over HTTP by `fixtures/capture_live_vllm.py`),
//! beside `engine_fixtures.rs`' frames from vLLM 0.33.0's encoder: two versions, one form.
//! `fixtures/vllm-0.32.0-live.json` holds the same batches as JSON and the prompt's tokens.

use kvmesh_engine_events::{EngineBatch, EngineEvent, Layout, decode_batch};

const STORED: &[u8] = include_bytes!("fixtures/vllm-0.32.0-live-stored.msgpack");
const SALTED: &[u8] = include_bytes!("fixtures/vllm-0.32.0-live-salted.msgpack");
const EVICTED: &[u8] = include_bytes!("fixtures/vllm-0.32.0-live-evicted.msgpack");
const CLEARED: &[u8] = include_bytes!("fixtures/vllm-0.32.0-live-cleared.msgpack");
const SUMMARY: &str = include_str!("fixtures/vllm-0.32.0-live.json");

/// The engine's hashes of the capture's 114-token prompt (3 full blocks of 32).
const HASHES: [u64; 3] = [
    11_898_044_840_904_432_240,
    10_345_117_535_258_039_679,
    11_585_055_738_669_227_301,
];

fn decode(frame: &[u8]) -> EngineBatch {
    let batch = decode_batch(Layout::Vllm, frame).expect("a live vLLM frame");
    assert_eq!(batch.malformed_events, 0);
    assert_eq!(batch.dp_rank, Some(0));
    batch
}

fn prompt_ids() -> Vec<u32> {
    let summary: serde_json::Value = serde_json::from_str(SUMMARY).expect("the capture's JSON");
    summary["prompt_token_ids"]
        .as_array()
        .expect("prompt_token_ids")
        .iter()
        .map(|id| id.as_u64().expect("a token id") as u32)
        .collect()
}

#[test]
fn a_stored_prompt_names_its_full_blocks_and_their_tokens() {
    let batch = decode(STORED);
    let ids = prompt_ids();
    assert_eq!(ids.len(), 114);
    assert_eq!(
        batch.events,
        vec![EngineEvent::Stored {
            block_hashes: HASHES.to_vec(),
            parent: None,
            token_ids: ids[..96].to_vec(),
            block_size: 32,
            lora_name: None,
            mm_hashes: vec![],
            cache_salt: None,
        }]
    );
}

#[test]
fn a_salted_prompt_carries_its_salt_on_the_first_block_and_other_hashes() {
    let batch = decode(SALTED);
    let [
        EngineEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            cache_salt,
            mm_hashes,
            ..
        },
    ] = &batch.events[..]
    else {
        panic!("one store: {:?}", batch.events);
    };
    assert_eq!(cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!((parent, token_ids), (&None, &prompt_ids()[..96].to_vec()));
    assert!(
        mm_hashes.iter().all(Vec::is_empty),
        "a salt is not a multimodal hash"
    );
    assert_eq!(block_hashes.len(), 3);
    for hash in block_hashes {
        assert!(
            !HASHES.contains(hash),
            "the salt changes every block's hash"
        );
    }
}

#[test]
fn an_eviction_removes_blocks_one_event_each_before_the_store_that_caused_it() {
    let batch = decode(EVICTED);
    let removed: Vec<u64> = batch
        .events
        .iter()
        .filter_map(|event| match event {
            EngineEvent::Removed { block_hashes } => {
                assert_eq!(block_hashes.len(), 1);
                Some(block_hashes[0])
            }
            _ => None,
        })
        .collect();
    assert_eq!(removed.len(), 4);
    for hash in HASHES {
        assert!(
            removed.contains(&hash),
            "the first prompt's blocks were evicted"
        );
    }
    assert!(matches!(
        batch.events.last(),
        Some(EngineEvent::Stored { parent: None, .. })
    ));
    assert!(matches!(
        batch.events[..4],
        [EngineEvent::Removed { .. }, ..]
    ));
}

#[test]
fn reset_prefix_cache_clears_all_blocks() {
    assert_eq!(decode(CLEARED).events, vec![EngineEvent::Cleared]);
}

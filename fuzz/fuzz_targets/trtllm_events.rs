//! An answer of TensorRT-LLM's `POST /kv_cache_events` as the agent reads it
//! (`kvmesh_engine_events::trtllm`): `decode_trtllm_events`, then each event through a
//! `TrtllmView`.
//!
//! Whatever the bytes: nothing panics; an answer read holds one event or one malformed count
//! per element of the JSON array a generic reading finds; and a `stored` event becomes a
//! `Stored` of exactly its blocks less the partial one dropped, with their tokens.

#![no_main]

use kvmesh_engine_events::{EngineEvent, TrtllmData, TrtllmView, decode_trtllm_events};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(poll) = decode_trtllm_events(data) else {
        return;
    };
    if let Ok(Value::Array(items)) = serde_json::from_slice::<Value>(data) {
        assert_eq!(poll.events.len() + poll.malformed_events, items.len());
    }
    let mut view = TrtllmView::new(4);
    for event in &poll.events {
        let step = view.translate(event);
        if let (
            TrtllmData::Stored { blocks, .. },
            Some(EngineEvent::Stored {
                block_hashes,
                token_ids,
                ..
            }),
        ) = (&event.data, &step.event)
        {
            let full = &blocks[..blocks.len() - step.partial_blocks];
            let hashes: Vec<u64> = full.iter().map(|b| b.block_hash).collect();
            assert_eq!(block_hashes, &hashes);
            let tokens: Vec<u32> = full
                .iter()
                .flat_map(|b| b.token_ids.iter().copied())
                .collect();
            assert_eq!(token_ids, &tokens);
        }
    }
});

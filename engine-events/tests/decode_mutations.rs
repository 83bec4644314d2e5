//! Fuzz-style tests of the KV event decoder (`decode_batch`), which reads whatever an engine
//! publishes: the real engines' frames of `tests/fixtures/`, cut short or mutated (bytes
//! changed, inserted, removed, two frames spliced), are decoded in either engine's layout.
//! They run in every `cargo test`; the cargo-fuzz target `engine_events` of `fuzz/` starts
//! from the same frames and goes further (docs/fuzzing.md).

use kvmesh_engine_events::{Layout, decode_batch};
use proptest::prelude::*;

const FRAMES: &[&[u8]] = &[
    include_bytes!("fixtures/vllm-0.33.0-block-stored.msgpack"),
    include_bytes!("fixtures/vllm-0.33.0-block-removed.msgpack"),
    include_bytes!("fixtures/vllm-0.33.0-all-blocks-cleared.msgpack"),
    include_bytes!("fixtures/vllm-0.33.0-mixed-dp1.msgpack"),
    include_bytes!("fixtures/vllm-0.33.0-bytes-hashes.msgpack"),
    include_bytes!("fixtures/vllm-0.33.0-cache-salt.msgpack"),
    include_bytes!("fixtures/vllm-0.32.0-live-stored.msgpack"),
    include_bytes!("fixtures/vllm-0.32.0-live-evicted.msgpack"),
    include_bytes!("fixtures/vllm-0.32.0-live-salted.msgpack"),
    include_bytes!("fixtures/vllm-0.32.0-live-cleared.msgpack"),
    include_bytes!("fixtures/sglang-0.5.23-block-stored.msgpack"),
    include_bytes!("fixtures/sglang-0.5.23-block-removed.msgpack"),
    include_bytes!("fixtures/sglang-0.5.23-all-blocks-cleared.msgpack"),
    include_bytes!("fixtures/sglang-0.5.23-mixed-dp1.msgpack"),
];

const LAYOUTS: [Layout; 2] = [Layout::Vllm, Layout::Sglang];

/// Decodes `bytes` as both layouts; a decoded batch's counts stay within what the bytes can
/// hold (every event and every malformed one takes at least a byte).
fn decode_both(bytes: &[u8]) -> usize {
    let mut decoded = 0;
    for layout in LAYOUTS {
        if let Ok(batch) = decode_batch(layout, bytes) {
            assert!(batch.events.len() + batch.malformed_events <= bytes.len());
            decoded += 1;
        }
    }
    decoded
}

#[test]
fn every_real_frame_cut_short_is_refused() {
    for frame in FRAMES {
        assert!(decode_both(frame) > 0, "a real frame decodes");
        for end in 0..frame.len() {
            assert_eq!(
                decode_both(&frame[..end]),
                0,
                "cut at {end} of {}",
                frame.len()
            );
        }
    }
}

/// One change to a frame: overwrite, insert or remove the byte at a position.
#[derive(Debug, Clone)]
enum Edit {
    Set(prop::sample::Index, u8),
    Insert(prop::sample::Index, u8),
    Remove(prop::sample::Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, byte)| Edit::Set(at, byte)),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, byte)| Edit::Insert(at, byte)),
        any::<prop::sample::Index>().prop_map(Edit::Remove),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_and_spliced_frames_never_panic(
        first in prop::sample::select(FRAMES),
        second in prop::sample::select(FRAMES),
        splice in any::<(prop::sample::Index, prop::sample::Index)>(),
        spliced in any::<bool>(),
        edits in prop::collection::vec(edit(), 0..6),
    ) {
        let mut bytes = if spliced {
            let mut joined = first[..splice.0.index(first.len() + 1)].to_vec();
            joined.extend_from_slice(&second[splice.1.index(second.len() + 1)..]);
            joined
        } else {
            first.to_vec()
        };
        for edit in edits {
            match edit {
                Edit::Set(at, byte) if !bytes.is_empty() => {
                    let at = at.index(bytes.len());
                    bytes[at] = byte;
                }
                Edit::Insert(at, byte) => bytes.insert(at.index(bytes.len() + 1), byte),
                Edit::Remove(at) if !bytes.is_empty() => {
                    bytes.remove(at.index(bytes.len()));
                }
                _ => {}
            }
        }
        decode_both(&bytes);
    }
}

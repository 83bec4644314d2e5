//! TensorRT-LLM's KV cache events against answers of trtllm-serve's `POST /kv_cache_events`
//! that TensorRT-LLM's own serializer (`KVCacheEventSerializer`) and block hasher wrote:
//! `tests/fixtures/trtllm/` at the repository root (its README says how, and what each file
//! holds). Every file there is decoded and checked here, field by field, then played in the
//! order an engine would have produced it through [`TrtllmView`], the way the agent does, with
//! the blocks each rank ends up holding asserted exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use kvmesh_engine_events::{
    EngineEvent, IgnoreReason, TrtllmData, TrtllmEvent, TrtllmPoll, TrtllmView,
    decode_trtllm_events,
};

/// `tokens_per_block` of every fixture.
const BLOCK: usize = 32;

// Block hashes (TensorRT-LLM's `hash_v1_block_key`), named after the first token id / 1000
// and the block's place in its sequence, as the fixtures' README names them.
const A0: u64 = 10_007_796_145_622_571_252;
const A1: u64 = 12_240_282_022_063_672_032;
const A2: u64 = 1_080_960_234_905_467_848;
const B1: u64 = 6_726_971_718_156_553_359;
const B2: u64 = 12_303_374_122_995_310_893;
const C0: u64 = 5_664_346_210_333_573_144;
const C1: u64 = 6_161_438_533_280_750_791;
const D: u64 = 478_434_844_705_578_212;
const E: u64 = 3_403_290_691_871_187_510;
const F2: u64 = 13_149_099_777_789_160_903;
const F3: u64 = 10_901_258_342_417_315_825;
const G0: u64 = 2_331_836_160_557_600_235;
const G1: u64 = 5_983_075_474_381_721_154;
const H: u64 = 3_311_146_924_812_935_306;
const I0: u64 = 10_670_370_077_808_376_313;
const I1: u64 = 11_740_133_757_056_550_265;

/// Every fixture file, in the order its engine produced it within its scenario.
const FILES: [&str; 10] = [
    "single-01-created.json",
    "single-02-stored.json",
    "single-03-evicted.json",
    "single-04-empty.json",
    "single-05-restored.json",
    "single-06-restarted.json",
    "overflow-01-created.json",
    "overflow-02-dropped.json",
    "adp-01.json",
    "vswa-01.json",
];

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/trtllm")
}

fn read(name: &str) -> TrtllmPoll {
    let path = dir().join(name);
    let body = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let poll = decode_trtllm_events(&body).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(
        poll.malformed_events, 0,
        "{name}: {:?}",
        poll.malformed_reason
    );
    poll
}

/// `(event_id, rank, window, type)` of each event.
fn outline(poll: &TrtllmPoll) -> Vec<(u64, u32, Option<u64>, &'static str)> {
    poll.events
        .iter()
        .map(|e| {
            let kind = match e.data {
                TrtllmData::Created { .. } => "created",
                TrtllmData::Stored { .. } => "stored",
                TrtllmData::Removed { .. } => "removed",
                TrtllmData::Updated { .. } => "updated",
                TrtllmData::Unknown => "unknown",
            };
            (e.event_id, e.dp_rank, e.window_size, kind)
        })
        .collect()
}

/// A `stored` event's parent and `(hash, first token, tokens)` per block; every block's token
/// ids run on from its first, with no extra keys, on the GPU.
fn stored(event: &TrtllmEvent) -> (Option<u64>, Vec<(u64, u32, usize)>) {
    let TrtllmData::Stored { parent, blocks } = &event.data else {
        panic!("not a stored event: {event:?}");
    };
    let blocks = blocks
        .iter()
        .map(|b| {
            let first = b.token_ids[0];
            let expected: Vec<u32> = (first..first + b.token_ids.len() as u32).collect();
            assert_eq!(b.token_ids, expected);
            assert!(!b.extra_keys && b.cache_level == 0 && b.cache_salt.is_none());
            (b.block_hash, first, b.token_ids.len())
        })
        .collect();
    (*parent, blocks)
}

fn removed(event: &TrtllmEvent) -> &[u64] {
    match &event.data {
        TrtllmData::Removed { block_hashes } => block_hashes,
        other => panic!("not a removed event: {other:?}"),
    }
}

#[test]
fn every_fixture_file_is_checked() {
    let mut found: Vec<String> = std::fs::read_dir(dir())
        .expect("tests/fixtures/trtllm")
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.ends_with(".json").then_some(name)
        })
        .collect();
    found.sort();
    let mut listed: Vec<String> = FILES.iter().map(|s| s.to_string()).collect();
    listed.sort();
    assert_eq!(
        found, listed,
        "a fixture this test does not check, or one gone"
    );
}

#[test]
fn the_single_engine_fixtures_decode_as_written() {
    let created = read("single-01-created.json");
    assert_eq!(outline(&created), [(0, 0, Some(4096), "created")]);
    assert_eq!(
        created.events[0].data,
        TrtllmData::Created {
            blocks_per_cache_level: vec![2048, 0]
        }
    );

    let stored_poll = read("single-02-stored.json");
    assert_eq!(
        outline(&stored_poll),
        [(1, 0, Some(4096), "stored"), (2, 0, Some(4096), "stored")]
    );
    assert_eq!(
        stored(&stored_poll.events[0]),
        (None, vec![(A0, 1000, 32), (A1, 1032, 32), (A2, 1064, 16)])
    );
    assert_eq!(
        stored(&stored_poll.events[1]),
        (Some(A0), vec![(B1, 2000, 32), (B2, 2032, 16)])
    );
    assert!(A0 > i64::MAX as u64, "read as u64, not i64 or f64");

    let evicted = read("single-03-evicted.json");
    assert_eq!(
        outline(&evicted),
        [
            (3, 0, Some(4096), "removed"),
            (4, 0, Some(4096), "stored"),
            (5, 0, Some(4096), "removed")
        ]
    );
    assert_eq!(removed(&evicted.events[0]), [A2, A1]);
    assert_eq!(
        stored(&evicted.events[1]),
        (None, vec![(C0, 3000, 32), (C1, 3032, 32)])
    );
    assert_eq!(removed(&evicted.events[2]), [B2]);

    assert!(read("single-04-empty.json").events.is_empty());

    let restored = read("single-05-restored.json");
    assert_eq!(outline(&restored), [(6, 0, Some(4096), "stored")]);
    assert_eq!(
        stored(&restored.events[0]),
        (Some(A0), vec![(A1, 1032, 32), (D, 4000, 32)]),
        "the same tokens after the same parent: the same hash"
    );

    let restarted = read("single-06-restarted.json");
    assert_eq!(
        outline(&restarted),
        [(0, 0, Some(4096), "created"), (1, 0, Some(4096), "stored")]
    );
    assert_eq!(stored(&restarted.events[1]), (None, vec![(E, 5000, 32)]));
}

#[test]
fn the_overflow_adp_and_vswa_fixtures_decode_as_written() {
    assert_eq!(
        outline(&read("overflow-01-created.json")),
        [(0, 0, Some(4096), "created")]
    );
    let dropped = read("overflow-02-dropped.json");
    assert_eq!(
        outline(&dropped),
        [(3, 0, Some(4096), "stored"), (4, 0, Some(4096), "stored")],
        "1 and 2 were dropped by the engine's full queue"
    );
    assert_eq!(stored(&dropped.events[0]), (None, vec![(F2, 6200, 32)]));
    assert_eq!(stored(&dropped.events[1]), (None, vec![(F3, 6300, 32)]));

    let adp = read("adp-01.json");
    assert_eq!(
        outline(&adp),
        [
            (0, 0, Some(4096), "created"),
            (1, 0, Some(4096), "stored"),
            (0, 1, Some(4096), "created"),
            (1, 1, Some(4096), "stored"),
            (2, 1, Some(4096), "removed")
        ]
    );
    assert_eq!(
        adp.events[0].data,
        TrtllmData::Created {
            blocks_per_cache_level: vec![1024, 0]
        }
    );
    assert_eq!(
        stored(&adp.events[1]),
        (None, vec![(G0, 7000, 32), (G1, 7032, 32)])
    );
    assert_eq!(
        stored(&adp.events[3]),
        (None, vec![(G0, 7000, 32), (H, 7500, 32)]),
        "the same tokens give the same hash on both ranks"
    );
    assert_eq!(removed(&adp.events[4]), [H]);

    let vswa = read("vswa-01.json");
    assert_eq!(
        outline(&vswa),
        [
            (0, 0, Some(512), "created"),
            (1, 0, Some(4096), "created"),
            (2, 0, Some(512), "stored"),
            (3, 0, Some(4096), "stored"),
            (4, 0, Some(512), "removed")
        ]
    );
    for event in &vswa.events[2..4] {
        assert_eq!(stored(event), (None, vec![(I0, 8000, 32), (I1, 8032, 32)]));
    }
    assert_eq!(removed(&vswa.events[4]), [I1, I0]);
}

/// Blocks per rank as the agent's table would hold them, from the view's events.
#[derive(Default)]
struct Held {
    ranks: BTreeMap<u32, BTreeSet<u64>>,
    partial_blocks: usize,
    ignored: Vec<IgnoreReason>,
    cleared: usize,
}

impl Held {
    /// Plays `files` through `view`.
    fn play(&mut self, view: &mut TrtllmView, files: &[&str]) {
        for name in files {
            for event in read(name).events {
                let step = view.translate(&event);
                self.partial_blocks += step.partial_blocks;
                let rank = self.ranks.entry(event.dp_rank).or_default();
                match step.event {
                    None => {}
                    Some(EngineEvent::Stored {
                        block_hashes,
                        token_ids,
                        block_size,
                        parent,
                        ..
                    }) => {
                        assert_eq!(block_size, BLOCK, "{name}");
                        assert_eq!(token_ids.len(), block_hashes.len() * BLOCK, "{name}");
                        assert!(
                            parent.is_none_or(|p| rank.contains(&p)),
                            "{name}: a known parent"
                        );
                        rank.extend(block_hashes);
                    }
                    Some(EngineEvent::Removed { block_hashes }) => {
                        for hash in block_hashes {
                            assert!(rank.remove(&hash), "{name}: removed {hash} unknown");
                        }
                    }
                    Some(EngineEvent::Cleared) => {
                        rank.clear();
                        self.cleared += 1;
                    }
                    Some(EngineEvent::Ignored(reason)) => self.ignored.push(reason),
                    Some(EngineEvent::TierStored { .. } | EngineEvent::TierRemoved { .. }) => {
                        panic!("{name}: TensorRT-LLM's reading places no block in a lower tier")
                    }
                }
            }
        }
    }

    fn rank(&self, rank: u32) -> BTreeSet<u64> {
        self.ranks.get(&rank).cloned().unwrap_or_default()
    }
}

#[test]
fn a_single_engine_keeps_its_full_blocks_and_a_restart_clears_them() {
    let mut view = TrtllmView::new(BLOCK);
    let mut held = Held::default();
    held.play(&mut view, &FILES[..2]);
    assert_eq!(held.rank(0), BTreeSet::from([A0, A1, B1]));
    assert_eq!(held.partial_blocks, 2, "A2 and B2 are partial");
    assert_eq!(view.capacity(), Some(2048));
    held.play(&mut view, &FILES[2..5]);
    assert_eq!(
        held.rank(0),
        BTreeSet::from([A0, A1, B1, C0, C1, D]),
        "A1 evicted and stored again; the partial A2 and B2 removed without a miss"
    );
    assert_eq!(held.cleared, 0);
    held.play(&mut view, &FILES[5..6]);
    assert_eq!(held.cleared, 1, "the created of a restarted engine");
    assert_eq!(held.rank(0), BTreeSet::from([E]));
    assert!(held.ignored.is_empty());
}

#[test]
fn a_lost_stretch_leaves_the_blocks_after_it() {
    let mut view = TrtllmView::new(BLOCK);
    let mut held = Held::default();
    held.play(&mut view, &FILES[6..8]);
    assert_eq!(held.rank(0), BTreeSet::from([F2, F3]));
    assert_eq!(held.cleared, 0);
}

#[test]
fn attention_dp_ranks_hold_their_own_blocks() {
    let mut view = TrtllmView::new(BLOCK);
    let mut held = Held::default();
    held.play(&mut view, &["adp-01.json"]);
    assert_eq!(held.rank(0), BTreeSet::from([G0, G1]));
    assert_eq!(held.rank(1), BTreeSet::from([G0]));
    assert_eq!(view.capacity(), Some(1024));
}

#[test]
fn only_the_largest_attention_window_is_followed() {
    let mut view = TrtllmView::new(BLOCK);
    let mut held = Held::default();
    held.play(&mut view, &["vswa-01.json"]);
    assert_eq!(held.rank(0), BTreeSet::from([I0, I1]));
    assert_eq!(
        held.ignored,
        [IgnoreReason::KvGroup, IgnoreReason::KvGroup],
        "the stored and removed of window 512"
    );
    assert_eq!((view.window(), view.capacity()), (Some(4096), Some(2048)));
}

use std::time::Duration;

use super::*;
use crate::hash::BlockHasher;

const W1: WorkerKey = WorkerKey::new(1, 0);
const W2: WorkerKey = WorkerKey::new(2, 0);

fn hashes(tokens: std::ops::Range<u32>) -> BlockHashes {
    let tokens: Vec<u32> = tokens.collect();
    BlockHasher::new(4, None).expect("block size").hash(&tokens)
}

fn config(ttl_secs: u64, max_blocks: usize) -> ApproxConfig {
    ApproxConfig {
        ttl: Duration::from_secs(ttl_secs),
        max_blocks,
        prune_target_ratio: 0.5,
    }
}

#[test]
fn recorded_blocks_match_until_they_expire() {
    let index = ApproxIndex::new(config(10, 1000)).expect("valid");
    let t0 = Instant::now();
    let request = hashes(0..40);
    let outcome = index.record(W1, &request, t0);
    assert_eq!(outcome.inserted, 10);
    let scores = index.find_matches(&request.sequence, t0 + Duration::from_secs(9));
    assert_eq!(scores.depth(W1), 10);
    let scores = index.find_matches(&request.sequence, t0 + Duration::from_secs(10));
    assert!(scores.is_empty(), "expiry at exactly the TTL");
    let stats = index.stats();
    assert_eq!(stats.predicted_blocks, 0);
    assert_eq!(stats.totals.expired, 10);
    assert_eq!(index.index_stats().distinct_blocks, 0);
}

#[test]
fn re_recording_refreshes_the_shared_prefix_only() {
    let index = ApproxIndex::new(config(10, 1000)).expect("valid");
    let t0 = Instant::now();
    let long = hashes(0..40);
    let short = hashes(0..16);
    index.record(W1, &long, t0);
    let outcome = index.record(W1, &short, t0 + Duration::from_secs(5));
    assert_eq!(outcome.refreshed, 4);
    assert_eq!(outcome.inserted, 0);
    let later = t0 + Duration::from_secs(12);
    assert_eq!(index.find_matches(&long.sequence, later).depth(W1), 4);
    assert_eq!(index.cached_blocks(), vec![(W1, 4)]);
    let outcome = index.expire(t0 + Duration::from_secs(15));
    assert_eq!(outcome.expired, 4);
}

#[test]
fn extending_a_predicted_prefix_stores_only_the_new_tail() {
    let index = ApproxIndex::new(config(10, 1000)).expect("valid");
    let t0 = Instant::now();
    index.record(W1, &hashes(0..16), t0);
    let long = hashes(0..40);
    let outcome = index.record(W1, &long, t0);
    assert_eq!((outcome.refreshed, outcome.inserted), (4, 6));
    assert_eq!(index.find_matches(&long.sequence, t0).depth(W1), 10);
    assert_eq!(index.index_stats().orphan_blocks, 0);
}

#[test]
fn size_bound_prunes_earliest_expiry_then_deepest() {
    let index = ApproxIndex::new(config(100, 10)).expect("valid");
    let t0 = Instant::now();
    let old = hashes(1000..1024);
    let new = hashes(0..24);
    index.record(W1, &old, t0);
    let outcome = index.record(W2, &new, t0 + Duration::from_secs(1));
    // 12 pairs > 10: prune to 5, the 6 older ones first, then the deepest newer one.
    assert_eq!(outcome.pruned, 7);
    assert_eq!(index.stats().predicted_blocks, 5);
    let now = t0 + Duration::from_secs(2);
    assert!(index.find_matches(&old.sequence, now).is_empty());
    assert_eq!(index.find_matches(&new.sequence, now).depth(W2), 5);
    assert_eq!(index.stats().totals.pruned, 7);
}

#[test]
fn removing_a_worker_drops_its_predictions() {
    let index = ApproxIndex::new(config(10, 1000)).expect("valid");
    let t0 = Instant::now();
    let request = hashes(0..16);
    index.record(W1, &request, t0);
    index.record(W2, &request, t0);
    index.remove_worker(1);
    let scores = index.find_matches(&request.sequence, t0);
    assert_eq!(scores.workers.len(), 1);
    assert_eq!(scores.depth(W2), 4);
    assert_eq!(index.stats().predicted_blocks, 4);
    index.expire(t0 + Duration::from_secs(10));
    assert_eq!(index.stats().predicted_blocks, 0);
    assert_eq!(index.index_stats().worker_blocks, 0);
}

#[test]
fn invalid_config_is_rejected() {
    assert!(ApproxIndex::new(config(0, 10)).is_err());
    assert_eq!(
        ApproxIndex::new(ApproxConfig::default())
            .expect("defaults")
            .config()
            .max_blocks,
        DEFAULT_MAX_BLOCKS
    );
}

#[test]
fn a_prompt_recorded_in_parts_is_recorded_as_a_whole() {
    let t0 = Instant::now();
    let request = hashes(0..40);
    let whole = ApproxIndex::new(config(10, 1000)).expect("valid");
    whole.record(W1, &request, t0);
    let parts = ApproxIndex::new(config(10, 1000)).expect("valid");
    for range in [0..3, 3..4, 4..9, 9..10, 10..12] {
        parts.record_blocks(W1, &request, range, t0);
    }
    let scores = |index: &ApproxIndex, at| index.find_matches(&request.sequence, at).depth(W1);
    assert_eq!(scores(&parts, t0), 10);
    assert_eq!(
        parts.index_stats().distinct_blocks,
        whole.index_stats().distinct_blocks
    );
    assert_eq!(parts.stats().totals.inserted, 10);
    assert_eq!(
        scores(&parts, t0 + Duration::from_secs(10)),
        0,
        "one expiry"
    );

    let half = ApproxIndex::new(config(10, 1000)).expect("valid");
    half.record_blocks(W1, &request, 0..5, t0);
    assert_eq!(half.find_matches(&request.sequence, t0).depth(W1), 5);
}

use kvmesh_kv::{BlockHasher, KvIndex, WorkerKey};

use super::*;

const W: WorkerKey = WorkerKey::new(1, 0);

fn tokens(n: u32) -> Vec<u32> {
    (0..n).collect()
}

fn apply_all(index: &KvIndex, events: &[KvEvent]) {
    for e in events {
        index.apply(W, e);
    }
}

#[test]
fn stored_blocks_get_kvmesh_sequence_hashes() {
    let mut table = RankTable::new(4).expect("table");
    let toks = tokens(12);
    let mut out = Vec::new();
    table
        .stored(None, &[100, 101], &toks[..8], 4, None, &[], None, &mut out)
        .expect("root");
    table
        .stored(Some(101), &[102], &toks[8..], 4, None, &[], None, &mut out)
        .expect("child");
    let expected = BlockHasher::new(4, None).expect("hasher").hash(&toks);
    let published: Vec<SequenceHash> = out
        .iter()
        .flat_map(|e| match e {
            KvEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.sequence).collect(),
            _ => vec![],
        })
        .collect();
    assert_eq!(published, expected.sequence);
    let index = KvIndex::new();
    apply_all(&index, &out);
    assert_eq!(index.find_matches(&expected.sequence).depth(W), 3);
    assert_eq!(table.len(), 3);
}

#[test]
fn lora_blocks_hash_with_the_lora_seed() {
    let mut table = RankTable::new(4).expect("table");
    let toks = tokens(4);
    let mut out = Vec::new();
    table
        .stored(
            None,
            &[1],
            &toks,
            4,
            Some("my-adapter"),
            &[],
            None,
            &mut out,
        )
        .expect("lora store");
    let expected = BlockHasher::new(4, Some("my-adapter"))
        .expect("hasher")
        .hash(&toks);
    assert!(
        matches!(&out[0], KvEvent::Stored { blocks, .. } if blocks[0].sequence == expected.sequence[0])
    );
    let plain = BlockHasher::new(4, None).expect("hasher").hash(&toks);
    assert_ne!(plain.sequence[0], expected.sequence[0]);
}

#[test]
fn salted_stores_match_salted_requests_only() {
    let mut table = RankTable::new(4).expect("table");
    let toks = tokens(12);
    let mut out = Vec::new();
    table
        .stored(
            None,
            &[1, 2],
            &toks[..8],
            4,
            None,
            &[],
            Some("tenant-a"),
            &mut out,
        )
        .expect("salted root");
    // The continuation names the salt too: after a parent it is not applied again.
    table
        .stored(
            Some(2),
            &[3],
            &toks[8..],
            4,
            None,
            &[],
            Some("tenant-a"),
            &mut out,
        )
        .expect("child");
    // The same prompt unsalted, under other engine ids (vLLM hashes it differently).
    table
        .stored(None, &[11, 12, 13], &toks, 4, None, &[], None, &mut out)
        .expect("unsalted root");
    let index = KvIndex::new();
    apply_all(&index, &out);
    let mut hasher = BlockHasher::new(4, None).expect("hasher");
    let a = hasher.hash_salted(&toks, Some("tenant-a"));
    let b = hasher.hash_salted(&toks, Some("tenant-b"));
    let plain = hasher.hash(&toks);
    assert_eq!(index.find_matches(&a.sequence).depth(W), 3);
    assert_eq!(index.find_matches(&plain.sequence).depth(W), 3);
    assert_eq!(index.find_matches(&b.sequence).depth(W), 0);
    assert_eq!(
        table.len(),
        6,
        "the salted and unsalted blocks are distinct"
    );
}

#[test]
fn duplicate_stores_are_refcounted_and_split_chains() {
    let mut table = RankTable::new(2).expect("table");
    let mut out = Vec::new();
    table
        .stored(None, &[1, 2], &[1, 2, 3, 4], 2, None, &[], None, &mut out)
        .expect("first");
    out.clear();
    // Blocks 1 and 2 again, extended by 3: only 3 is new, published after its parent 2.
    table
        .stored(
            None,
            &[1, 2, 3],
            &[1, 2, 3, 4, 5, 6],
            2,
            None,
            &[],
            None,
            &mut out,
        )
        .expect("again");
    assert_eq!(out.len(), 1, "one event expected: {out:?}");
    let KvEvent::Stored { parent, blocks } = &out[0] else {
        panic!("a Stored event expected: {out:?}");
    };
    let hashes = BlockHasher::new(2, None)
        .expect("hasher")
        .hash(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].external, ExternalHash::own(hashes.sequence[2]));
    assert_eq!(
        parent.map(|p| p.external),
        Some(ExternalHash::own(hashes.sequence[1]))
    );
    out.clear();
    // One removal of a twice-stored block keeps it; the second evicts it.
    assert_eq!(table.removed(&[2], &mut out), 0);
    assert!(out.is_empty());
    assert_eq!(table.removed(&[2, 99], &mut out), 1);
    assert_eq!(
        out,
        vec![KvEvent::Removed {
            blocks: vec![ExternalHash::own(hashes.sequence[1])]
        }]
    );
}

#[test]
fn blocks_are_sent_by_sequence_hash_once_whatever_ids_the_engine_uses() {
    let mut table = RankTable::new(2).expect("table");
    let hashes = BlockHasher::new(2, None)
        .expect("hasher")
        .hash(&[1, 2, 3, 4]);
    let [a, b] = [hashes.sequence[0], hashes.sequence[1]];
    let mut out = Vec::new();
    table
        .stored(None, &[1, 2], &[1, 2, 3, 4], 2, None, &[], None, &mut out)
        .expect("first");
    assert_eq!(
        out,
        vec![KvEvent::Stored {
            parent: None,
            blocks: vec![
                StoredBlock {
                    external: ExternalHash::own(a),
                    local: hashes.local[0],
                    sequence: a,
                },
                StoredBlock {
                    external: ExternalHash::own(b),
                    local: hashes.local[1],
                    sequence: b,
                },
            ],
        }]
    );
    out.clear();
    // The same content under other engine ids: already held, nothing is sent.
    table
        .stored(None, &[11, 12], &[1, 2, 3, 4], 2, None, &[], None, &mut out)
        .expect("again");
    assert!(out.is_empty(), "{out:?}");
    // A block goes when its last id does.
    assert_eq!(table.removed(&[1, 2], &mut out), 0);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(table.removed(&[12], &mut out), 0);
    assert_eq!(
        out,
        vec![KvEvent::Removed {
            blocks: vec![ExternalHash::own(b)]
        }]
    );
    out.clear();
    // An id reused for other content: its old block goes first (no other id holds it), then
    // the new one is stored.
    table
        .stored(None, &[11], &[7, 8], 2, None, &[], None, &mut out)
        .expect("reuse");
    let c = BlockHasher::new(2, None)
        .expect("hasher")
        .hash(&[7, 8])
        .sequence[0];
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(
        out[0],
        KvEvent::Removed {
            blocks: vec![ExternalHash::own(a)]
        }
    );
    assert!(
        matches!(&out[1], KvEvent::Stored { parent: None, blocks } if blocks[0].external == ExternalHash::own(c))
    );
    // The proxy's index holds exactly what the engine holds.
    let index = KvIndex::new();
    table
        .stored(None, &[21, 22], &[1, 2, 3, 4], 2, None, &[], None, &mut out)
        .expect("back");
    apply_all(&index, &out);
    assert_eq!(index.find_matches(&hashes.sequence).depth(W), 2);
    let mut gone = Vec::new();
    table.removed(&[11, 21, 22], &mut gone);
    apply_all(&index, &gone);
    assert_eq!(index.stats().worker_blocks, 0);
}

#[test]
fn misses_change_nothing() {
    let mut table = RankTable::new(2).expect("table");
    let mut out = Vec::new();
    assert_eq!(
        table.stored(Some(7), &[1], &[1, 2], 2, None, &[], None, &mut out),
        Err(Miss::UnknownParent)
    );
    assert_eq!(
        table.stored(None, &[1], &[1, 2, 3], 2, None, &[], None, &mut out),
        Err(Miss::TokenCount)
    );
    assert_eq!(
        table.stored(None, &[1], &[1, 2, 3, 4], 4, None, &[], None, &mut out),
        Err(Miss::BlockSize)
    );
    assert!(out.is_empty() && table.is_empty());
}

#[test]
fn clearing_one_rank_of_many_removes_its_blocks() {
    let mut table = RankTable::new(2).expect("table");
    let mut out = Vec::new();
    table
        .stored(None, &[1, 2], &[1, 2, 3, 4], 2, None, &[], None, &mut out)
        .expect("store");
    assert_eq!(table.tier_stored(CacheTier::Host, &[1], &mut out), 0);
    let mut tiers: [Vec<KvEvent>; 3] = Default::default();
    table.cleared(false, &mut tiers);
    let KvEvent::Removed { blocks } = &tiers[0][0] else {
        panic!("expected a removal: {tiers:?}");
    };
    assert_eq!(blocks.len(), 2);
    // Its host copy goes too, in the host tier's own removal.
    let first = BlockHasher::new(2, None)
        .expect("hasher")
        .hash(&[1, 2])
        .sequence[0];
    assert_eq!(
        tiers[1],
        vec![KvEvent::Removed {
            blocks: vec![ExternalHash::own(first)]
        }]
    );
    assert!(tiers[2].is_empty());
    assert!(table.is_empty() && table.tier_len(CacheTier::Host) == 0);
    let mut tiers: [Vec<KvEvent>; 3] = Default::default();
    table.cleared(true, &mut tiers);
    assert_eq!(tiers, [vec![KvEvent::Cleared], vec![], vec![]]);
}

/// Stores `ids` (parent first) of 2-token blocks with tokens from `first`.
fn store(table: &mut RankTable, parent: Option<u64>, ids: &[u64], first: u32) -> Vec<KvEvent> {
    let tokens: Vec<u32> = (first..first + 2 * ids.len() as u32).collect();
    let mut out = Vec::new();
    table
        .stored(parent, ids, &tokens, 2, None, &[], None, &mut out)
        .expect("store");
    out
}

#[test]
fn offloaded_blocks_keep_their_device_hashes_after_the_device_evicts_them() {
    let mut table = RankTable::new(2).expect("table");
    let device = store(&mut table, None, &[1, 2, 3], 0);
    let hashes = BlockHasher::new(2, None)
        .expect("hasher")
        .hash(&(0..6).collect::<Vec<u32>>());
    // The connector offloads them one chunk at a time, not in prefix order.
    let mut host = Vec::new();
    assert_eq!(table.tier_stored(CacheTier::Host, &[2], &mut host), 0);
    assert_eq!(table.tier_stored(CacheTier::Host, &[1, 3], &mut host), 0);
    // An id the engine never stored is counted, not invented.
    assert_eq!(table.tier_stored(CacheTier::Host, &[99], &mut host), 1);
    let mut evicted = Vec::new();
    table.removed(&[1, 2, 3], &mut evicted);
    assert!(table.is_empty() && table.tier_len(CacheTier::Host) == 3);

    let index = KvIndex::new();
    let host_worker = W.in_tier(CacheTier::Host);
    apply_all(&index, &device);
    for event in &host {
        index.apply(host_worker, event);
    }
    apply_all(&index, &evicted);
    let scores = index.find_matches(&hashes.sequence);
    assert_eq!((scores.depth(W), scores.depth(host_worker)), (0, 3));

    // A chunk announced twice leaves at its second removal; a snapshot rebuilds the tier.
    assert_eq!(table.tier_stored(CacheTier::Host, &[3], &mut host), 0);
    let mut removed = Vec::new();
    assert_eq!(table.tier_removed(CacheTier::Host, &[3], &mut removed), 0);
    assert!(removed.is_empty() && table.tier_len(CacheTier::Host) == 3);
    let rebuilt = KvIndex::new();
    for event in table.tier_snapshot(CacheTier::Host) {
        rebuilt.apply(host_worker, &event);
    }
    assert_eq!(rebuilt.find_matches(&hashes.sequence).depth(host_worker), 3);
    assert_eq!(
        table.tier_removed(CacheTier::Host, &[3, 3, 42], &mut removed),
        2
    );
    assert_eq!(
        removed,
        vec![KvEvent::Removed {
            blocks: vec![ExternalHash::own(hashes.sequence[2])]
        }]
    );
}

#[test]
fn a_tier_without_removals_drops_its_oldest_blocks_past_its_bound() {
    let mut table = RankTable::new(2).expect("table").with_max_tier_blocks(2);
    store(&mut table, None, &[1, 2, 3], 0);
    let mut disk = Vec::new();
    table.tier_stored(CacheTier::Disk, &[1, 2], &mut disk);
    disk.clear();
    table.tier_stored(CacheTier::Disk, &[3], &mut disk);
    assert_eq!(table.tier_len(CacheTier::Disk), 2);
    let first = BlockHasher::new(2, None)
        .expect("hasher")
        .hash(&[0, 1])
        .sequence[0];
    assert_eq!(
        disk.last(),
        Some(&KvEvent::Removed {
            blocks: vec![ExternalHash::own(first)]
        })
    );
    // A block on disk is known there: the host tier can take it from there.
    let mut removed = Vec::new();
    table.removed(&[1, 2, 3], &mut removed);
    let mut host = Vec::new();
    assert_eq!(table.tier_stored(CacheTier::Host, &[2, 3, 1], &mut host), 1);
    assert_eq!(table.tier_len(CacheTier::Host), 2);
}

#[test]
fn snapshots_rebuild_the_same_index() {
    let mut table = RankTable::new(2).expect("table");
    let mut live = Vec::new();
    let t: Vec<u32> = (0..16).collect();
    // A tree: 1-2-3 and 1-2-4, and a separate root 5-6 whose 6 is then evicted.
    table
        .stored(None, &[1, 2, 3], &t[..6], 2, None, &[], None, &mut live)
        .expect("a");
    table
        .stored(Some(2), &[4], &t[8..10], 2, None, &[], None, &mut live)
        .expect("b");
    table
        .stored(None, &[5, 6], &t[10..14], 2, None, &[], None, &mut live)
        .expect("c");
    table.removed(&[6], &mut live);
    let live_index = KvIndex::new();
    apply_all(&live_index, &live);

    let snapshot = table.snapshot();
    let rebuilt = KvIndex::new();
    apply_all(&rebuilt, &snapshot);
    assert_eq!(rebuilt.cached_blocks(), live_index.cached_blocks());
    let stored: usize = snapshot
        .iter()
        .map(|e| match e {
            KvEvent::Stored { blocks, .. } => blocks.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(stored, table.len());
    // Linear chains are merged: 1-2-3 is one event, 4 and 5 one each.
    assert_eq!(snapshot.len(), 3);
    let branch: Vec<u32> = t[..4].iter().chain(&t[8..10]).copied().collect();
    for (query, depth) in [(&t[..6], 3), (&branch[..], 3), (&t[10..14], 1)] {
        let hashes = BlockHasher::new(2, None).expect("hasher").hash(query);
        assert_eq!(rebuilt.find_matches(&hashes.sequence).depth(W), depth);
        assert_eq!(live_index.find_matches(&hashes.sequence).depth(W), depth);
    }
}

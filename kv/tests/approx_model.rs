//! Approximate mode against a naive model of TTL expiry and size pruning.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use kvmesh_kv::{
    ApproxConfig, ApproxIndex, ApproxOutcome, BlockHashes, LocalBlockHash, OverlapScores,
    SequenceHash, WorkerKey, WorkerOverlap, extend_sequence_hashes,
};
use proptest::prelude::*;

const TTL_MS: u64 = 10_000;
const MAX_BLOCKS: usize = 12;
const TARGET: usize = 6;

/// (worker, block) → (expiry in ms since the start, depth).
#[derive(Debug, Default)]
struct Model {
    entries: HashMap<(WorkerKey, SequenceHash), (u64, u32)>,
    totals: ApproxOutcome,
}

impl Model {
    fn expire(&mut self, now: u64) -> u64 {
        let before = self.entries.len();
        self.entries.retain(|_, &mut (expiry, _)| expiry > now);
        (before - self.entries.len()) as u64
    }

    fn record(&mut self, worker: WorkerKey, hashes: &BlockHashes, now: u64) -> ApproxOutcome {
        let mut outcome = ApproxOutcome {
            expired: self.expire(now),
            ..ApproxOutcome::default()
        };
        let expiry = now + TTL_MS;
        for (depth, &sequence) in hashes.sequence.iter().enumerate() {
            match self.entries.get_mut(&(worker, sequence)) {
                Some(entry) => {
                    entry.0 = entry.0.max(expiry);
                    outcome.refreshed += 1;
                }
                None => {
                    self.entries
                        .insert((worker, sequence), (expiry, depth as u32));
                    outcome.inserted += 1;
                }
            }
        }
        if self.entries.len() > MAX_BLOCKS {
            let mut order: Vec<_> = self
                .entries
                .iter()
                .map(|(&(w, s), &(expiry, depth))| (expiry, Reverse(depth), w, s))
                .collect();
            order.sort_unstable();
            let excess = self.entries.len() - TARGET;
            for &(_, _, w, s) in &order[..excess] {
                self.entries.remove(&(w, s));
            }
            outcome.pruned = excess as u64;
        }
        self.totals.inserted += outcome.inserted;
        self.totals.refreshed += outcome.refreshed;
        self.totals.expired += outcome.expired;
        self.totals.pruned += outcome.pruned;
        outcome
    }

    fn find_matches(&mut self, query: &[SequenceHash], now: u64) -> OverlapScores {
        self.totals.expired += self.expire(now);
        let mut per_worker: BTreeMap<WorkerKey, Vec<SequenceHash>> = BTreeMap::new();
        for &(w, s) in self.entries.keys() {
            per_worker.entry(w).or_default().push(s);
        }
        let workers = per_worker
            .into_iter()
            .filter_map(|(worker, held)| {
                let depth = query.iter().take_while(|s| held.contains(s)).count() as u32;
                (depth > 0).then_some(WorkerOverlap {
                    worker,
                    depth,
                    cached_blocks: held.len() as u64,
                })
            })
            .collect();
        OverlapScores { workers }
    }
}

#[derive(Debug, Clone)]
enum Action {
    Record {
        worker: WorkerKey,
        doc: usize,
        len: usize,
        advance_ms: u64,
    },
    Query {
        doc: usize,
        advance_ms: u64,
    },
}

const DOCS: [&[u64]; 4] = [
    &[1, 2, 3, 4, 5, 6],
    &[1, 2, 3, 9, 9],
    &[7, 7, 7, 7],
    &[1, 5],
];

fn hashes(doc: usize, len: usize) -> BlockHashes {
    let local: Vec<LocalBlockHash> = DOCS[doc][..len.min(DOCS[doc].len())]
        .iter()
        .copied()
        .map(LocalBlockHash)
        .collect();
    let mut sequence = Vec::new();
    extend_sequence_hashes(None, &local, &mut sequence);
    BlockHashes { local, sequence }
}

fn action() -> impl Strategy<Value = Action> {
    let advance = prop_oneof![2 => Just(0u64), 3 => 0..4_000u64, 1 => Just(TTL_MS)];
    prop_oneof![
        3 => ((0..3u64).prop_map(|i| WorkerKey::new(i, 0)), 0..DOCS.len(), 1..7usize, advance.clone())
            .prop_map(|(worker, doc, len, advance_ms)| Action::Record { worker, doc, len, advance_ms }),
        1 => (0..DOCS.len(), advance).prop_map(|(doc, advance_ms)| Action::Query { doc, advance_ms }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn approx_matches_the_model(actions in prop::collection::vec(action(), 1..40)) {
        let config = ApproxConfig {
            ttl: Duration::from_millis(TTL_MS),
            max_blocks: MAX_BLOCKS,
            prune_target_ratio: TARGET as f64 / MAX_BLOCKS as f64,
        };
        prop_assert_eq!(config.prune_target(), TARGET);
        let index = ApproxIndex::new(config).expect("valid config");
        let mut model = Model::default();
        let start = Instant::now();
        let mut now = 0u64;
        for action in &actions {
            match action {
                Action::Record { worker, doc, len, advance_ms } => {
                    now += advance_ms;
                    let h = hashes(*doc, *len);
                    let got = index.record(*worker, &h, start + Duration::from_millis(now));
                    prop_assert_eq!(got, model.record(*worker, &h, now), "record {:?}", action);
                }
                Action::Query { doc, advance_ms } => {
                    now += advance_ms;
                    let h = hashes(*doc, usize::MAX);
                    let got = index.find_matches(&h.sequence, start + Duration::from_millis(now));
                    prop_assert_eq!(got, model.find_matches(&h.sequence, now), "query {:?}", action);
                }
            }
            for doc in 0..DOCS.len() {
                let h = hashes(doc, usize::MAX);
                let got = index.find_matches(&h.sequence, start + Duration::from_millis(now));
                prop_assert_eq!(got, model.find_matches(&h.sequence, now));
            }
            let stats = index.stats();
            prop_assert_eq!(stats.predicted_blocks, model.entries.len());
            prop_assert_eq!(stats.totals, model.totals);
            prop_assert_eq!(index.index_stats().orphan_blocks, 0, "predictions stay prefix-closed");
        }
    }
}

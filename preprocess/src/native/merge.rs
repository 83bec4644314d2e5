//! The BPE merge loop: starting from one symbol per byte, repeatedly merge the adjacent pair
//! with the lowest merge rank, the leftmost one on ties, until no adjacent pair has a merge.
//!
//! This is the order Hugging Face's `Word::merge_all` produces (a heap of `(rank, position)`
//! without dropout). Short pieces use a scan over flat arrays on the stack; long ones a heap
//! over a linked list, so a piece of `n` bytes costs `O(n log n)`, not `O(n²)`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A merge rule: its rank (lower merges first) and the id of the merged token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Merge {
    pub(crate) rank: u32,
    pub(crate) id: u32,
}

/// Pieces of at most this many bytes are merged by scanning.
const SCAN_MAX: usize = 48;

/// No merge: sorts after every real rank.
const NO_RANK: u32 = u32::MAX;

/// Appends the ids of `piece` merged to `out`, starting from the symbols `byte_ids[b]` of its
/// bytes; `pair` gives the merge of two adjacent symbols, if any.
pub(crate) fn merge(
    piece: &[u8],
    byte_ids: &[u32; 256],
    pair: impl Fn(u32, u32) -> Option<Merge>,
    out: &mut Vec<u32>,
) {
    if piece.len() <= SCAN_MAX {
        merge_by_scan(piece, byte_ids, pair, out);
    } else {
        merge_by_heap(piece, byte_ids, pair, out);
    }
}

/// The merge loop for short pieces: find the lowest rank by a linear scan each round.
fn merge_by_scan(
    piece: &[u8],
    byte_ids: &[u32; 256],
    pair: impl Fn(u32, u32) -> Option<Merge>,
    out: &mut Vec<u32>,
) {
    let mut len = piece.len().min(SCAN_MAX);
    let mut ids = [0u32; SCAN_MAX];
    for (id, &b) in ids.iter_mut().zip(piece) {
        *id = byte_ids[usize::from(b)];
    }
    // merges[i]: the merge of ids[i] and ids[i + 1], for i < len - 1.
    let mut merges = [Merge {
        rank: NO_RANK,
        id: 0,
    }; SCAN_MAX];
    let lookup = |left: u32, right: u32| {
        pair(left, right).unwrap_or(Merge {
            rank: NO_RANK,
            id: 0,
        })
    };
    for i in 1..len {
        merges[i - 1] = lookup(ids[i - 1], ids[i]);
    }
    while len > 1 {
        let mut best = 0;
        for i in 1..len - 1 {
            if merges[i].rank < merges[best].rank {
                best = i;
            }
        }
        if merges[best].rank == NO_RANK {
            break;
        }
        ids[best] = merges[best].id;
        ids.copy_within(best + 2..len, best + 1);
        if best + 2 < len {
            merges.copy_within(best + 2..len - 1, best + 1);
        }
        len -= 1;
        if best + 1 < len {
            merges[best] = lookup(ids[best], ids[best + 1]);
        }
        if best > 0 {
            merges[best - 1] = lookup(ids[best - 1], ids[best]);
        }
    }
    out.extend_from_slice(&ids[..len]);
}

/// No neighbour.
const NONE: usize = usize::MAX;

/// The id of a symbol merged into its left neighbour (token ids are below `u32::MAX`).
pub(crate) const REMOVED: u32 = u32::MAX;

/// A candidate merge in the heap: ordered by rank, then position. It is stale when the
/// symbols at `left` and after it are no longer `left_id` and `right_id`.
type Candidate = Reverse<(u32, usize, u32, u32, u32)>;

/// The merge loop for long pieces: a heap of candidate merges over a linked list of symbols.
fn merge_by_heap(
    piece: &[u8],
    byte_ids: &[u32; 256],
    pair: impl Fn(u32, u32) -> Option<Merge>,
    out: &mut Vec<u32>,
) {
    let len = piece.len();
    if len == 0 {
        return;
    }
    let mut ids: Vec<u32> = piece.iter().map(|&b| byte_ids[usize::from(b)]).collect();
    let mut next: Vec<usize> = (1..=len).collect();
    next[len - 1] = NONE;
    let mut prev: Vec<usize> = (0..len).map(|i| i.wrapping_sub(1)).collect();
    prev[0] = NONE;
    let candidate = |at: usize, left: u32, right: u32| -> Option<Candidate> {
        pair(left, right).map(|m| Reverse((m.rank, at, left, right, m.id)))
    };
    let mut heap: BinaryHeap<Candidate> = (1..len)
        .filter_map(|i| candidate(i - 1, ids[i - 1], ids[i]))
        .collect();
    while let Some(Reverse((_, at, left_id, right_id, merged))) = heap.pop() {
        let right = next[at];
        if right == NONE || ids[at] != left_id || ids[right] != right_id {
            continue;
        }
        ids[at] = merged;
        ids[right] = REMOVED;
        let after = next[right];
        next[at] = after;
        if after != NONE {
            prev[after] = at;
            heap.extend(candidate(at, merged, ids[after]));
        }
        let before = prev[at];
        if before != NONE {
            heap.extend(candidate(before, ids[before], merged));
        }
    }
    let mut at = 0;
    while at != NONE {
        out.push(ids[at]);
        at = next[at];
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// A toy merge table over the symbols 0..4: `(left, right) -> (rank, id)`.
    fn table() -> HashMap<(u32, u32), Merge> {
        let rules = [
            ((0, 0), 10), // "aa"
            ((1, 2), 11), // "bc"
            ((10, 1), 12),
            ((0, 11), 13),
            ((10, 10), 14),
            ((2, 2), 15),
            ((3, 0), 16),
            ((16, 10), 17),
            ((13, 15), 18),
        ];
        rules
            .into_iter()
            .enumerate()
            .map(|(rank, (pair, id))| {
                (
                    pair,
                    Merge {
                        rank: rank as u32,
                        id,
                    },
                )
            })
            .collect()
    }

    fn run(symbols: &[u8], by_heap: bool) -> Vec<u32> {
        let table = table();
        let pair = |a, b| table.get(&(a, b)).copied();
        let byte_ids: [u32; 256] = std::array::from_fn(|b| b as u32);
        let mut out = Vec::new();
        if by_heap {
            merge_by_heap(symbols, &byte_ids, pair, &mut out);
        } else {
            merge_by_scan(symbols, &byte_ids, pair, &mut out);
        }
        out
    }

    #[test]
    fn lowest_rank_first_then_leftmost() {
        // "aaa": (a, a) at 0 wins the tie with (a, a) at 1.
        assert_eq!(run(&[0, 0, 0], false), [10, 0]);
        assert_eq!(run(&[0, 0, 0], true), [10, 0]);
        // "aaaa" -> "aa" "aa" -> "aaaa".
        assert_eq!(run(&[0, 0, 0, 0], false), [14]);
        // "abc": (b, c) is the only merge, then (a, bc).
        assert_eq!(run(&[0, 1, 2], false), [13]);
        assert_eq!(run(&[0, 1, 2], true), [13]);
        assert_eq!(run(&[3], false), [3]);
        assert_eq!(run(&[3], true), [3]);
    }

    proptest! {
        #[test]
        fn scan_and_heap_agree(symbols in proptest::collection::vec(0u8..4, 0..=SCAN_MAX)) {
            prop_assert_eq!(run(&symbols, false), run(&symbols, true));
        }
    }
}

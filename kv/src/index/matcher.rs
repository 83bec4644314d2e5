//! Prefix-depth search over the block table: galloping search on prefix-closed holder sets.
//!
//! For a query `q[0..n]` let `S_i` be the workers holding `q[i]`. For a worker whose blocks are
//! prefix-closed (it holds the parent of every block it holds), `w ∈ S_i` implies `w ∈ S_j` for
//! all `j < i`, so its match depth is the number of levels containing it, and the depths of all
//! such workers can be found with O(k · log n) probes, k being the number of distinct depths:
//! keep the set `cur` of workers still matching, gallop to the last level that contains all of
//! `cur`, score the workers missing from the next level, continue with the rest.
//!
//! Workers that are not prefix-closed (they hold orphans) may get a wrong depth here; the
//! caller re-checks those with [`linear_depth`]. Workers that are prefix-closed always get the
//! exact depth, whatever the other workers in `cur` do, because a level is only accepted when
//! every worker of `cur` holds it.

use crate::hash::SequenceHash;

use super::block_table::BlockTable;
use super::slot_bits::SlotBits;

/// Working sets of one search, reusable across searches.
#[derive(Debug, Default)]
pub(crate) struct MatchScratch {
    current: SlotBits,
    probe: SlotBits,
    first_miss: SlotBits,
}

/// Appends `(slot, depth)` for every worker holding `query[0]`, with `depth` its number of
/// leading query blocks held (exact for prefix-closed workers).
pub(crate) fn prefix_depths(
    table: &BlockTable,
    query: &[SequenceHash],
    scratch: &mut MatchScratch,
    out: &mut Vec<(u32, u32)>,
) {
    let n = query.len();
    let Some(&first) = query.first() else {
        return;
    };
    let MatchScratch {
        current,
        probe,
        first_miss,
    } = scratch;
    table.holders_into(table.key(first), current);
    let mut lo = 0;
    while !current.is_empty() {
        // Invariant: every worker in `current` holds query[lo].
        let mut good = lo;
        let mut bad = n;
        let mut step = 1;
        let mut galloping = true;
        while good + 1 < bad {
            let j = if galloping {
                (good + step).min(bad - 1)
            } else {
                good + (bad - good) / 2
            };
            table.holders_into(table.key(query[j]), probe);
            if current.is_subset_of(probe) {
                good = j;
                step *= 2;
            } else {
                bad = j;
                galloping = false;
                std::mem::swap(probe, first_miss);
            }
        }
        if bad == n {
            break;
        }
        // `bad` fits in u32: queries longer than u32::MAX blocks are cut by the caller.
        let depth = bad as u32;
        current.for_each_not_in(first_miss, |slot| out.push((slot, depth)));
        current.intersect_with(first_miss);
        lo = bad;
    }
    let full = n as u32;
    out.extend(current.iter().map(|slot| (slot, full)));
}

/// The number of leading blocks of `query` that worker `slot` holds, checked level by level.
pub(crate) fn linear_depth(table: &BlockTable, query: &[SequenceHash], slot: u32) -> u32 {
    query
        .iter()
        .take_while(|&&sequence| table.holds(table.key(sequence), slot))
        .count() as u32
}

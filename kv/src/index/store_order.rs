//! One worker's engine ids in the order they were first stored, for eviction.

use std::collections::VecDeque;

/// Engine-id keys in store order (oldest event first, each event's deepest block first), kept
/// only when the index has a bound.
///
/// Removals and moves leave stale entries behind (an engine id no longer mapped, or mapped and
/// listed twice); eviction skips them. So that stale entries cannot pile up, the queue is
/// compacted a bounded number of entries at a time: `[0, kept)` are entries already checked and
/// kept, `[kept, read)` are dropped ones awaiting truncation, `[read, len)` are not yet checked.
#[derive(Debug, Default)]
pub(crate) struct StoreOrder {
    entries: VecDeque<u64>,
    kept: usize,
    read: usize,
}

/// Stale entries tolerated before compaction starts: this many plus the live entries.
const SLACK: usize = 1024;

impl StoreOrder {
    /// Heap bytes of the queue.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<u64>()
    }

    /// Records that engine-id key `external` was stored now.
    pub(crate) fn push(&mut self, external: u64) {
        self.entries.push_back(external);
    }

    /// A mark for [`StoreOrder::reverse_since`]: the position of the next entry pushed.
    pub(crate) fn mark(&self) -> usize {
        self.entries.len()
    }

    /// Reverses the entries pushed since `mark`, so that one event's deepest block is evicted
    /// first and its chain loses its tail before its head (no orphans behind it). Pushes only
    /// append after the entries a compaction checks, so they are not disturbed.
    pub(crate) fn reverse_since(&mut self, mark: usize) {
        let (mut low, mut high) = (mark, self.entries.len());
        while low + 1 < high {
            high -= 1;
            self.entries.swap(low, high);
            low += 1;
        }
    }

    /// The oldest entry, removed (it may be stale).
    pub(crate) fn pop(&mut self) -> Option<u64> {
        loop {
            let entry = self.entries.pop_front()?;
            if self.kept > 0 {
                self.kept -= 1;
                self.read -= 1;
                return Some(entry);
            }
            if self.read == 0 {
                return Some(entry);
            }
            // A dropped entry of the running compaction.
            self.read -= 1;
        }
    }

    /// Entries queued, stale ones included.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len() - (self.read - self.kept)
    }

    /// Checks at most `work` entries of a compaction, when one runs or when more than half of
    /// the entries could be stale (`live` bounds the engine ids mapped); `is_live` says whether an
    /// entry's engine id is still mapped.
    pub(crate) fn compact(&mut self, live: usize, work: usize, is_live: impl Fn(u64) -> bool) {
        if self.read == 0 && self.entries.len() <= 2 * live + SLACK {
            return;
        }
        for _ in 0..work {
            if self.read == self.entries.len() {
                self.entries.truncate(self.kept);
                self.kept = 0;
                self.read = 0;
                return;
            }
            let entry = self.entries[self.read];
            if is_live(entry) {
                self.entries[self.kept] = entry;
                self.kept += 1;
            }
            self.read += 1;
        }
    }

    /// Gives memory back once at most a quarter of the queue's capacity is used.
    pub(crate) fn shrink(&mut self) {
        if self.entries.len() * 4 < self.entries.capacity() {
            self.entries.shrink_to(self.entries.len() * 2);
        }
    }

    /// Forgets every entry.
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compaction_keeps_live_entries_in_order_while_popping() {
        let mut order = StoreOrder::default();
        let live = |entry: u64| !entry.is_multiple_of(3);
        for entry in 0..3000 {
            order.push(entry);
        }
        // 3000 entries, 2000 live: 3000 <= 2 * 2000 + SLACK, so nothing happens.
        order.compact(2000, 10, live);
        assert_eq!(order.len(), 3000);
        // Pretend few are live: compaction starts and runs in steps, interleaved with pops.
        order.compact(10, 100, live);
        assert_eq!(order.pop(), Some(1));
        assert_eq!(order.pop(), Some(2));
        order.push(3001);
        let mut calls = 1;
        while order.read > 0 {
            order.compact(10, 100, live);
            calls += 1;
        }
        // 2,999 entries, 100 checked per call; the two pops took checked ones back.
        assert_eq!(calls, 31);
        let rest: Vec<u64> = std::iter::from_fn(|| order.pop()).collect();
        let expected: Vec<u64> = (4..3000).filter(|&e| live(e)).chain([3001]).collect();
        assert_eq!(rest, expected);
    }

    #[test]
    fn reverse_since_reverses_only_the_last_pushes() {
        let mut order = StoreOrder::default();
        order.push(1);
        let mark = order.mark();
        for entry in 2..6 {
            order.push(entry);
        }
        order.reverse_since(mark);
        let all: Vec<u64> = std::iter::from_fn(|| order.pop()).collect();
        assert_eq!(all, vec![1, 5, 4, 3, 2]);
    }

    #[test]
    fn pops_skip_dropped_entries_of_a_running_compaction() {
        let mut order = StoreOrder::default();
        for entry in 0..2000 {
            order.push(entry);
        }
        // Nothing is live: the first 50 entries are dropped, none kept.
        order.compact(0, 50, |_| false);
        assert_eq!(order.len(), 1950);
        assert_eq!(order.pop(), Some(50));
        assert_eq!(order.len(), 1949);
    }
}

//! An intrusive doubly linked LRU list over block ids: O(1) push, remove and pop.

const NIL: u32 = u32::MAX;

/// Least-recently-released order of the inactive blocks.
#[derive(Debug)]
pub(crate) struct LruList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl LruList {
    /// An empty list able to hold ids `0..capacity`.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            prev: vec![NIL; capacity],
            next: vec![NIL; capacity],
            linked: vec![false; capacity],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Number of ids in the list.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `id` is in the list.
    pub(crate) fn contains(&self, id: u32) -> bool {
        self.linked[id as usize]
    }

    /// Appends `id` as the most recently used entry.
    pub(crate) fn push_back(&mut self, id: u32) {
        debug_assert!(!self.contains(id));
        let i = id as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.linked[i] = true;
        self.len += 1;
    }

    /// Unlinks `id`; returns false when it was not in the list.
    pub(crate) fn remove(&mut self, id: u32) -> bool {
        let i = id as usize;
        if !self.linked[i] {
            return false;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.linked[i] = false;
        self.len -= 1;
        true
    }

    /// Removes and returns the least recently used id.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let head = self.head;
        if head == NIL {
            return None;
        }
        self.remove(head);
        Some(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_removal() {
        let mut l = LruList::new(5);
        for id in [3, 1, 4, 0] {
            l.push_back(id);
        }
        assert_eq!(l.len(), 4);
        assert!(l.remove(1));
        assert!(!l.remove(1));
        assert!(!l.contains(2));
        assert_eq!(l.pop_front(), Some(3));
        l.push_back(3);
        assert_eq!(l.pop_front(), Some(4));
        assert_eq!(l.pop_front(), Some(0));
        assert_eq!(l.pop_front(), Some(3));
        assert_eq!(l.pop_front(), None);
        assert_eq!(l.len(), 0);
    }
}

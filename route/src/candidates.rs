//! What routing knows about the instances it chooses from: each one through [`Candidate`]
//! (implemented by the proxy's instance), one pick's view of them through [`CandidateSet`].

use std::sync::Arc;

/// One instance a request may be sent to, as routing sees it.
pub trait Candidate {
    /// Its stable id (the key of its load and of its cached blocks).
    fn id(&self) -> u64;
    /// Its URL (named in explanations and metrics).
    fn url(&self) -> &str;
    /// Requests in flight on it now.
    fn in_flight(&self) -> u64;
    /// Whether it may take requests at clock time `now_ms` (member, healthy, not ejected).
    fn is_available(&self, now_ms: u64) -> bool;
    /// The pool of its model it belongs to (`None`: none).
    fn pool(&self) -> Option<&str> {
        None
    }
    /// Whether it takes decode legs and whole requests (`false`: it only prefills).
    fn decodes(&self) -> bool {
        true
    }
}

/// A model's instances as one pick sees them; indices run `0..len()`.
pub trait CandidateSet {
    /// Number of instances (eligible or not).
    fn len(&self) -> usize;
    /// Whether there is no instance at all.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether instance `index` may be picked.
    fn is_eligible(&self, index: usize) -> bool;
    /// Requests in flight on instance `index`.
    fn in_flight(&self, index: usize) -> u64;
    /// The id of instance `index`.
    fn id(&self, index: usize) -> u64;
    /// The URL of instance `index`.
    fn url(&self, index: usize) -> &str;

    /// Number of eligible instances.
    fn eligible_count(&self) -> usize {
        (0..self.len()).filter(|&i| self.is_eligible(i)).count()
    }

    /// Index of the `n`-th eligible instance (0-based).
    fn nth_eligible(&self, n: usize) -> Option<usize> {
        (0..self.len()).filter(|&i| self.is_eligible(i)).nth(n)
    }
}

/// Instances already tried for one request (a bit set; no allocation below 64).
#[derive(Debug, Default)]
pub struct Excluded {
    low: u64,
    high: Vec<u64>,
}

impl Excluded {
    /// The items of `items` for which `exclude` holds, by index.
    pub fn matching<T>(items: &[T], exclude: impl Fn(&T) -> bool) -> Self {
        let mut excluded = Self::default();
        for (index, item) in items.iter().enumerate() {
            if exclude(item) {
                excluded.insert(index);
            }
        }
        excluded
    }

    /// Marks `index` as tried.
    #[inline]
    pub fn insert(&mut self, index: usize) {
        if index < 64 {
            self.low |= 1 << index;
        } else {
            let word = index / 64 - 1;
            if self.high.len() <= word {
                self.high.resize(word + 1, 0);
            }
            self.high[word] |= 1 << (index % 64);
        }
    }

    /// How many indexes are marked.
    pub fn len(&self) -> usize {
        let high: u32 = self.high.iter().map(|word| word.count_ones()).sum();
        (self.low.count_ones() + high) as usize
    }

    /// Whether no index is marked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `index` was tried.
    #[inline]
    pub fn contains(&self, index: usize) -> bool {
        if index < 64 {
            self.low & (1 << index) != 0
        } else {
            self.high
                .get(index / 64 - 1)
                .is_some_and(|word| word & (1 << (index % 64)) != 0)
        }
    }
}

/// A model's instances as seen by one pick: available at one clock time and not yet tried.
#[derive(Debug)]
pub struct Candidates<'a, C> {
    instances: &'a [Arc<C>],
    excluded: &'a Excluded,
    now_ms: u64,
}

impl<'a, C: Candidate> Candidates<'a, C> {
    /// `instances` at clock time `now_ms`, less those in `excluded`.
    #[inline]
    pub fn new(instances: &'a [Arc<C>], excluded: &'a Excluded, now_ms: u64) -> Self {
        Self {
            instances,
            excluded,
            now_ms,
        }
    }
}

impl<C: Candidate> CandidateSet for Candidates<'_, C> {
    #[inline]
    fn len(&self) -> usize {
        self.instances.len()
    }

    #[inline]
    fn is_eligible(&self, index: usize) -> bool {
        !self.excluded.contains(index)
            && self
                .instances
                .get(index)
                .is_some_and(|instance| instance.is_available(self.now_ms))
    }

    #[inline]
    fn in_flight(&self, index: usize) -> u64 {
        self.instances
            .get(index)
            .map_or(u64::MAX, |instance| instance.in_flight())
    }

    #[inline]
    fn id(&self, index: usize) -> u64 {
        self.instances
            .get(index)
            .map_or(u64::MAX, |instance| instance.id())
    }

    #[inline]
    fn url(&self, index: usize) -> &str {
        self.instances
            .get(index)
            .map_or("", |instance| instance.url())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matching_excludes_the_items_the_predicate_picks() {
        let items: Vec<usize> = (0..130).collect();
        let odd = Excluded::matching(&items, |n| n % 2 == 1);
        for n in items {
            assert_eq!(odd.contains(n), n % 2 == 1, "{n}");
        }
        assert_eq!(odd.len(), 65);
        assert!(Excluded::default().is_empty());
    }

    #[test]
    fn excluded_is_a_set_of_any_size() {
        let mut excluded = Excluded::default();
        for i in [0, 5, 63, 64, 127, 128, 1000] {
            assert!(!excluded.contains(i));
            excluded.insert(i);
            assert!(excluded.contains(i));
        }
        excluded.insert(5);
        assert_eq!(excluded.len(), 7, "each index once");
        assert!(!excluded.contains(1));
        assert!(!excluded.contains(65));
        assert!(!excluded.contains(999));
        assert!(!excluded.contains(5000));
    }
}

//! A bounded cache of token ids for long text pieces between added tokens.
//!
//! In a multi-turn conversation every request repeats the earlier turns; each turn's text sits
//! between `<|im_start|>role\n` and `<|im_end|>` and tokenizes on its own (see
//! [`crate::added_token_split`]), so its ids can be reused. Eviction keeps two generations:
//! when the current one holds half the capacity it becomes the previous one, and a hit in the
//! previous generation moves the entry back to the current one (an approximate LRU, O(1)).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

use xxhash_rust::xxh3::Xxh3Builder;

use crate::added_token_split::AddedTokenSplitter;

/// Pieces shorter than this are encoded directly: caching them costs more than it saves.
pub(crate) const MIN_CACHED_BYTES: usize = 256;

type Generation = HashMap<Box<str>, Arc<[u32]>, Xxh3Builder>;

/// xxh3 with a secret drawn for this process. Pieces are client text, so their buckets must not
/// be predictable; std's SipHash reads ≈ 1.5 GB/s, and a new piece is hashed three times
/// (looked up in both generations, then inserted), which was ≈ 8 % of a cold 128k-token
/// prompt's tokenization; xxh3 reads over ten times faster.
fn keyed_hasher() -> Xxh3Builder {
    let random = RandomState::new();
    let mut secret = [0u8; 192];
    for (i, word) in (0u64..).zip(secret.chunks_exact_mut(8)) {
        word.copy_from_slice(&random.hash_one(i).to_le_bytes());
    }
    Xxh3Builder::new().with_secret(secret)
}

#[derive(Debug)]
struct Generations {
    current: Generation,
    current_tokens: usize,
    previous: Generation,
}

/// Token ids of text pieces, bounded by a total token count.
pub(crate) struct SegmentCache {
    pub(crate) splitter: AddedTokenSplitter,
    /// Tokens one generation may hold (half the configured capacity).
    generation_tokens: usize,
    hasher: Xxh3Builder,
    state: Mutex<Generations>,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache")
            .field("splitter", &self.splitter)
            .field("generation_tokens", &self.generation_tokens)
            .finish_non_exhaustive()
    }
}

impl SegmentCache {
    /// A cache holding up to about `max_tokens` token ids.
    pub(crate) fn new(splitter: AddedTokenSplitter, max_tokens: usize) -> Self {
        let hasher = keyed_hasher();
        Self {
            splitter,
            generation_tokens: (max_tokens / 2).max(1),
            hasher,
            state: Mutex::new(Generations {
                current: HashMap::with_hasher(hasher),
                current_tokens: 0,
                previous: HashMap::with_hasher(hasher),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Generations> {
        // A panic while holding the lock cannot leave the maps inconsistent; keep using them.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The cached ids of `piece`, if any.
    pub(crate) fn get(&self, piece: &str) -> Option<Arc<[u32]>> {
        let mut state = self.lock();
        if let Some(ids) = state.current.get(piece) {
            return Some(ids.clone());
        }
        let (key, ids) = state.previous.remove_entry(piece)?;
        let evicted = self.insert_locked(&mut state, key, ids.clone());
        drop(state);
        drop(evicted);
        Some(ids)
    }

    /// Remembers the ids of `piece`.
    pub(crate) fn insert(&self, piece: &str, ids: Arc<[u32]>) {
        if ids.len() > self.generation_tokens {
            return;
        }
        let key: Box<str> = piece.into();
        let mut state = self.lock();
        let evicted = self.insert_locked(&mut state, key, ids);
        drop(state);
        drop(evicted);
    }

    /// Inserts under the lock; returns the generation it evicted, if any, for the caller to
    /// free after unlocking. A piece's copy and a generation's freeing (up to a million
    /// tokens' ids and their texts) stay out of the lock, which the short requests'
    /// preprocessing threads share with the long lane's lower-priority ones.
    fn insert_locked(
        &self,
        state: &mut Generations,
        key: Box<str>,
        ids: Arc<[u32]>,
    ) -> Option<Generation> {
        let mut evicted = None;
        if state.current_tokens + ids.len() > self.generation_tokens {
            let current = std::mem::replace(&mut state.current, HashMap::with_hasher(self.hasher));
            evicted = Some(std::mem::replace(&mut state.previous, current));
            state.current_tokens = 0;
        }
        state.current_tokens += ids.len();
        if let Some(old) = state.current.insert(key, ids) {
            state.current_tokens -= old.len();
        }
        evicted
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use tokenizers::Tokenizer;

    use super::*;

    fn cache(max_tokens: usize) -> SegmentCache {
        let t = Tokenizer::from_str(
            r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
                "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}}"#,
        )
        .unwrap();
        SegmentCache::new(AddedTokenSplitter::for_tokenizer(&t).unwrap(), max_tokens)
    }

    fn ids(n: u32) -> Arc<[u32]> {
        (0..n).collect::<Vec<_>>().into()
    }

    #[test]
    fn hits_and_misses() {
        let c = cache(100);
        assert!(c.get("a").is_none());
        c.insert("a", ids(3));
        assert_eq!(c.get("a").as_deref(), Some(&[0, 1, 2][..]));
    }

    #[test]
    fn old_generations_are_dropped_and_hits_survive() {
        let c = cache(20); // generations of 10 tokens
        c.insert("a", ids(6));
        c.insert("b", ids(6)); // rotates: previous = {a}
        assert!(c.get("a").is_some()); // promoted: rotates again, previous = {b}
        c.insert("c", ids(6)); // rotates: previous = {a}, {b} dropped
        assert!(c.get("b").is_none());
        assert!(c.get("c").is_some());
    }

    #[test]
    fn oversized_pieces_are_not_cached() {
        let c = cache(10);
        c.insert("big", ids(6));
        assert!(c.get("big").is_none());
    }
}

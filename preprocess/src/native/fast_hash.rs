//! A small non-cryptographic hash for the encoder's tables (vocabulary, merges, piece cache).
//!
//! FxHash-style (one multiply per 8 bytes), but with a folded 128-bit multiply so that every
//! input bit reaches the low bits `hashbrown` picks buckets with: a plain Fx hash of a merge key
//! `(left << 32) | right` would put every pair with the same right token in one bucket.

use std::hash::{BuildHasher, Hasher};

/// The multiplier (the 64-bit golden ratio).
const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// The high and low halves of a full 64 x 64-bit product, xored.
#[inline]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

/// The hasher; see the module docs.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FastHasher {
    hash: u64,
}

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = folded_multiply(self.hash ^ word, K);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    #[inline]
    fn write_u128(&mut self, n: u128) {
        self.add(n as u64);
        self.add((n >> 64) as u64);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

/// Builds [`FastHasher`]s (a fixed seed: the tables are keyed by the tokenizer file or bounded).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FastHashBuilder;

impl BuildHasher for FastHashBuilder {
    type Hasher = FastHasher;

    #[inline]
    fn build_hasher(&self) -> FastHasher {
        FastHasher::default()
    }
}

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastHashMap<K, V> = std::collections::HashMap<K, V, FastHashBuilder>;

#[cfg(test)]
mod tests {
    use super::*;

    fn hash_of(value: impl std::hash::Hash) -> u64 {
        FastHashBuilder.hash_one(value)
    }

    #[test]
    fn pairs_with_the_same_right_token_spread_over_buckets() {
        let buckets: std::collections::HashSet<u64> = (0..1000u64)
            .map(|left| hash_of((left << 32) | 7) & 0xfff)
            .collect();
        assert!(buckets.len() > 700, "{} distinct buckets", buckets.len());
    }

    #[test]
    fn byte_strings_of_different_lengths_differ() {
        assert_ne!(hash_of(&b"a"[..]), hash_of(&b"a\0"[..]));
        assert_ne!(hash_of(&b""[..]), hash_of(&b"\0"[..]));
        assert_ne!(hash_of(&b"abcdefgh1"[..]), hash_of(&b"abcdefgh2"[..]));
    }
}

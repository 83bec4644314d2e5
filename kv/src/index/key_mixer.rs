//! The keyed bijection from block hashes and engine ids to the keys the index's tables store.

use std::hash::{BuildHasher, RandomState};

/// A secret, invertible scrambling of 64-bit words.
///
/// Sequence hashes derive from client-chosen tokens with a public seed, and engine ids may be
/// small or sequential integers, so the tables never place them by their raw bits: they store
/// `mix(x)`, whose high bits (which place a key: shard, then bucket) depend on every input bit
/// and on per-process random keys. Every step (xor with a key, multiplication by an odd key, xor
/// with a right shift) is a bijection of `u64`, so distinct inputs keep distinct keys: full
/// 64-bit identity, no false matches. Mixing once per operation (nine instructions) also lets
/// every table compare stored keys directly.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyMixer {
    k0: u64,
    k1: u64,
    k2: u64,
}

impl KeyMixer {
    /// A mixer with fresh random keys.
    pub(crate) fn new() -> Self {
        let random = RandomState::new();
        Self {
            k0: random.hash_one(0x6d69_7865_7230_u64),
            k1: random.hash_one(0x6d69_7865_7231_u64) | 1,
            k2: random.hash_one(0x6d69_7865_7232_u64) | 1,
        }
    }

    /// The stored key of `word`.
    pub(crate) fn mix(&self, word: u64) -> u64 {
        // MurmurHash3's 64-bit finaliser with keyed multipliers, after a keyed xor. Its high
        // bits place the key: shard, then home bucket.
        let mut x = word ^ self.k0;
        x ^= x >> 33;
        x = x.wrapping_mul(self.k1);
        x ^= x >> 33;
        x = x.wrapping_mul(self.k2);
        x ^ (x >> 33)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn structured_inputs_spread_over_the_high_bits() {
        // Shards and buckets come from the high bits: 64 sequential or shifted inputs must not
        // pile up there.
        for _ in 0..100 {
            let mixer = KeyMixer::new();
            for shift in [0, 8, 32, 56] {
                for top in [54, 58] {
                    let spread: HashSet<u64> =
                        (0..64u64).map(|i| mixer.mix(i << shift) >> top).collect();
                    let buckets = 1 << (64 - top);
                    // 64 random keys fill ≈ 40.5 of 64 buckets (sd ≈ 2.5) and ≈ 62 of 1,024:
                    // both floors are over six standard deviations below, so a correct mixer
                    // never fails them, while a mixer that ignores the shifted bits fills 1.
                    let floor = if buckets >= 1024 { 50 } else { 25 };
                    assert!(
                        spread.len() >= floor,
                        "inputs i << {shift}: {} of {buckets}",
                        spread.len()
                    );
                }
            }
            assert_ne!(mixer.mix(1), mixer.mix(2));
        }
    }
}

//! A fast keyed hasher for maps keyed by 64-bit block hashes (and other integer ids: the
//! router's per-instance and per-request maps use it too).
//!
//! Block hashes are already uniformly distributed, so SipHash would be wasted work; but they are
//! derived from client-chosen tokens with a public seed, so using them as bucket indices directly
//! would let a client aim many blocks at one bucket, and engine block ids may be structured
//! (small or sequential integers). Two folded 64×64→128-bit multiplies with per-process random
//! keys keep hashing at a few cycles while every output bit depends on every input bit and the
//! bucket of a key stays unpredictable to clients.

use std::hash::{BuildHasher, Hasher, RandomState};

/// Builds [`KeyedHasher`]s that share two random keys drawn when the state is created.
#[derive(Debug, Clone, Copy)]
pub struct KeyedState {
    k0: u64,
    k1: u64,
    k2: u64,
}

impl KeyedState {
    /// A state with fresh random keys.
    pub fn new() -> Self {
        let random = RandomState::new();
        Self {
            k0: random.hash_one(0x6b76_6d65_7368_u64),
            k1: random.hash_one(0x6b65_7965_645f_u64) | 1,
            k2: random.hash_one(0x6669_6e69_7368_u64) | 1,
        }
    }
}

impl Default for KeyedState {
    fn default() -> Self {
        Self::new()
    }
}

impl BuildHasher for KeyedState {
    type Hasher = KeyedHasher;

    fn build_hasher(&self) -> KeyedHasher {
        KeyedHasher {
            state: self.k0,
            k1: self.k1,
            k2: self.k2,
        }
    }
}

/// Hasher for keys made of `u64`/`u32` words (block hashes, worker keys).
#[derive(Debug, Clone, Copy)]
pub struct KeyedHasher {
    state: u64,
    k1: u64,
    k2: u64,
}

/// Multiplies to 128 bits and folds the halves together.
fn folded_multiply(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

impl Hasher for KeyedHasher {
    fn finish(&self) -> u64 {
        folded_multiply(self.state, self.k2)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.state = folded_multiply(self.state ^ value, self.k1);
    }

    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distinct values of the low 8 bits (the bucket in a 256-bucket table) of 64 keys.
    fn low_byte_spread(state: &KeyedState, keys: impl Iterator<Item = u64>) -> usize {
        keys.map(|k| state.hash_one(k) & 0xff)
            .collect::<std::collections::HashSet<u64>>()
            .len()
    }

    #[test]
    fn equal_keys_hash_equal_and_structured_keys_spread() {
        // 64 random keys fill ~56 of 256 buckets on average; far fewer means poor mixing.
        for _ in 0..200 {
            let state = KeyedState::new();
            assert_eq!(state.hash_one(42u64), state.hash_one(42u64));
            for shift in [0, 8, 32, 40, 56] {
                let spread = low_byte_spread(&state, (0..64u64).map(|i| i << shift));
                assert!(spread >= 40, "keys i << {shift}: {spread} buckets");
            }
        }
    }

    #[test]
    fn byte_writes_are_supported() {
        let state = KeyedState::new();
        assert_eq!(state.hash_one("abc"), state.hash_one("abc"));
        assert_ne!(state.hash_one("abc"), state.hash_one("abd"));
    }
}

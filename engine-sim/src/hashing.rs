//! Block hashes.
//!
//! Two independent hash spaces:
//! - the **sequence hash** (kvmesh's and Dynamo's cache identity): local hash
//!   `XXH3_64(LE_u32 tokens, seed 1337)`, chained as
//!   `seq[i] = XXH3_64(LE_u64(seq[i-1]) ‖ LE_u64(local[i]), 1337)` with `seq[0] = local[0]`;
//! - the **engine hash** that KV events publish, deliberately different so consumers must
//!   re-hash: `SHA-256(parent engine hash as 8 bytes big-endian ‖ LE_u32 tokens)` (no parent
//!   bytes for the first block). Its integer form keeps the low 64 bits (the digest's last 8
//!   bytes, big-endian), the way vLLM folds its digests into integers; the chain uses that
//!   integer form of the parent.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every XXH3 block hash (Dynamo's `XXH3_SEED`).
pub const XXH3_SEED: u64 = 1337;

/// A block's engine hash: the full SHA-256 digest. KV events publish either the digest itself
/// (32 bytes) or its integer [`EngineHash::id`], as vLLM does with `ExternalBlockHash`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct EngineHash([u8; 32]);

impl EngineHash {
    /// Wraps a digest.
    pub fn from_digest(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// The 32-byte digest.
    pub fn digest(&self) -> &[u8; 32] {
        &self.0
    }

    /// The integer form: the digest's last 8 bytes read big-endian.
    pub fn id(&self) -> u64 {
        let mut low = [0u8; 8];
        low.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(low)
    }
}

/// Reusable scratch space for hashing token blocks without a per-block allocation.
#[derive(Debug, Default)]
pub struct BlockHasher {
    bytes: Vec<u8>,
}

impl BlockHasher {
    /// A hasher with an empty scratch buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Position-independent hash of one block of tokens.
    pub fn local_hash(&mut self, tokens: &[u32]) -> u64 {
        self.fill(tokens);
        xxh3_64_with_seed(&self.bytes, XXH3_SEED)
    }

    /// Engine hash of a block given its parent's engine hash id (`None` for the first block).
    pub fn engine_hash(&mut self, parent: Option<u64>, tokens: &[u32]) -> EngineHash {
        let mut digest = Sha256::new();
        if let Some(parent) = parent {
            digest.update(parent.to_be_bytes());
        }
        self.fill(tokens);
        digest.update(&self.bytes);
        EngineHash(digest.finalize().into())
    }

    /// Sequence hashes of every full block of `tokens` (a trailing partial block is skipped).
    pub fn sequence_hashes(&mut self, tokens: &[u32], block_size: usize) -> Vec<u64> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        self.extend_sequence_hashes(tokens, block_size, &mut out);
        out
    }

    /// Appends the sequence hashes of full blocks of `tokens` beyond the `hashes.len()` already
    /// known, chaining onto the last one.
    pub fn extend_sequence_hashes(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        hashes: &mut Vec<u64>,
    ) {
        if block_size == 0 {
            return;
        }
        let full = tokens.len() / block_size;
        for block in hashes.len()..full {
            let local = self.local_hash(&tokens[block * block_size..(block + 1) * block_size]);
            let seq = match hashes.last() {
                Some(&parent) => chain_hash(parent, local),
                None => local,
            };
            hashes.push(seq);
        }
    }

    fn fill(&mut self, tokens: &[u32]) {
        self.bytes.clear();
        self.bytes.reserve(tokens.len() * 4);
        for token in tokens {
            self.bytes.extend_from_slice(&token.to_le_bytes());
        }
    }
}

/// Chains a block's local hash onto its parent's sequence hash.
pub fn chain_hash(parent: u64, local: u64) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.to_le_bytes());
    bytes[8..].copy_from_slice(&local.to_le_bytes());
    xxh3_64_with_seed(&bytes, XXH3_SEED)
}

/// A 64-bit hash of a whole token sequence, used to seed deterministic outputs.
pub(crate) fn content_seed(tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for token in tokens {
        bytes.extend_from_slice(&token.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh3_seed_vector() {
        assert_eq!(
            xxh3_64_with_seed(b"test data", XXH3_SEED),
            13_226_331_709_069_118_873
        );
    }

    #[test]
    fn reference_vectors_block_16() {
        let tokens: Vec<u32> = (0..32).collect();
        let mut h = BlockHasher::new();
        assert_eq!(h.local_hash(&tokens[..16]), 15_310_707_395_893_867_146);
        assert_eq!(h.local_hash(&tokens[16..]), 15_292_316_782_987_903_195);
        assert_eq!(
            h.sequence_hashes(&tokens, 16),
            vec![15_310_707_395_893_867_146, 13_769_157_705_258_532_664]
        );
    }

    #[test]
    fn reference_vectors_block_64() {
        let tokens: Vec<u32> = (0..128).collect();
        let mut h = BlockHasher::new();
        assert_eq!(
            h.sequence_hashes(&tokens, 64),
            vec![3_480_597_578_098_033_343, 2_575_318_956_255_022_795]
        );
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        let tokens: Vec<u32> = (0..40).collect();
        assert_eq!(BlockHasher::new().sequence_hashes(&tokens, 16).len(), 2);
    }

    #[test]
    fn extending_matches_hashing_at_once() {
        let tokens: Vec<u32> = (0..100).collect();
        let mut h = BlockHasher::new();
        let mut hashes = h.sequence_hashes(&tokens[..40], 16);
        h.extend_sequence_hashes(&tokens, 16, &mut hashes);
        assert_eq!(hashes, h.sequence_hashes(&tokens, 16));
    }

    #[test]
    fn identical_blocks_at_different_depths_differ() {
        let tokens = vec![7u32; 32];
        let hashes = BlockHasher::new().sequence_hashes(&tokens, 16);
        assert_ne!(hashes[0], hashes[1]);
    }

    #[test]
    fn engine_hash_is_sha256_low_bits_and_differs_from_sequence_hash() {
        let tokens: Vec<u32> = (0..16).collect();
        let mut h = BlockHasher::new();
        let mut bytes = Vec::new();
        for t in &tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let digest = Sha256::digest(&bytes);
        let expected = u64::from_be_bytes(digest[24..32].try_into().unwrap_or_default());
        let first = h.engine_hash(None, &tokens);
        assert_eq!(first.id(), expected);
        assert_eq!(first.digest()[..], digest[..]);
        assert_ne!(first.id(), h.local_hash(&tokens));
        let child = h.engine_hash(Some(first.id()), &tokens);
        assert_ne!(child, first);
        assert_eq!(child, h.engine_hash(Some(first.id()), &tokens));
    }
}

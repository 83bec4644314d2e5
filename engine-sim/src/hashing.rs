//! Block hashes.
//!
//! Two independent hash spaces:
//! - the **sequence hash** (kvmesh's and Dynamo's cache identity): local hash
//!   `XXH3_64(LE_u32 tokens, seed)`, chained as
//!   `seq[i] = XXH3_64(LE_u64(seq[i-1]) ‖ LE_u64(local[i]), 1337)` with `seq[0] = local[0]`.
//!   The local seed is 1337 for the base model and, for a LoRA adapter's blocks,
//!   `1337 wrapping_add XXH3_64(UTF-8(lora_name), seed 0)` ([`lora_seed`], the rule of
//!   `kvmesh_kv::lora_seed`); chaining keeps seed 1337 either way. A request's `cache_salt`
//!   re-hashes the local hash of its **first** block only, as
//!   `XXH3_64(LE_u64(local) ‖ UTF-8(salt), CACHE_SALT_SEED)` ([`salted_local_hash`], the rule
//!   of `kvmesh_kv::salted_local_hash`), and the chain carries it into every later block;
//! - the **engine hash** that KV events publish, deliberately different so consumers must
//!   re-hash: `SHA-256(parent engine hash as 8 bytes big-endian ‖ LE_u32 tokens ‖ lora ‖ salt)`
//!   (no parent bytes for the first block), where `lora` is `UTF-8(lora_name)` for an
//!   adapter's blocks and nothing for the base model's, and `salt` is
//!   `b"\0cache_salt\0" ‖ UTF-8(cache_salt)` for a salted request's first block and nothing
//!   otherwise: the way vLLM folds the LoRA name (every block) and the salt (the block at token
//!   0) into its block hash through `extra_keys`. Its integer form keeps the low 64 bits (the
//!   digest's last 8 bytes, big-endian), the way vLLM folds its digests into integers; the chain
//!   uses that integer form of the parent.
//!
//! Both spaces therefore keep an adapter's blocks apart from the base model's and from every
//! other adapter's, and a salted prompt's blocks apart from the same prompt's under another
//! salt or none: the prefix cache (keyed by sequence hash) never matches across them.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every XXH3 block hash (Dynamo's `XXH3_SEED`).
pub const XXH3_SEED: u64 = 1337;

/// The seed of local block hashes: [`XXH3_SEED`] for the base model (`None` or an empty name),
/// `XXH3_SEED wrapping_add XXH3_64(UTF-8(name), seed 0)` for a LoRA adapter's blocks.
pub fn lora_seed(lora_name: Option<&str>) -> u64 {
    match lora_name {
        Some(name) if !name.is_empty() => {
            XXH3_SEED.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0))
        }
        _ => XXH3_SEED,
    }
}

/// Seed of the hash that folds a request's `cache_salt` into its first block: the ASCII bytes
/// `cachesal` read big-endian (`kvmesh_kv::CACHE_SALT_SEED`).
pub const CACHE_SALT_SEED: u64 = 0x6361_6368_6573_616c;

/// The local hash of a sequence's first block under `cache_salt`:
/// `XXH3_64(LE_u64(local) ‖ UTF-8(salt), CACHE_SALT_SEED)` (`kvmesh_kv::salted_local_hash`).
pub fn salted_local_hash(local: u64, salt: &str) -> u64 {
    let mut bytes = Vec::with_capacity(8 + salt.len());
    bytes.extend_from_slice(&local.to_le_bytes());
    bytes.extend_from_slice(salt.as_bytes());
    xxh3_64_with_seed(&bytes, CACHE_SALT_SEED)
}

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

    /// Position-independent hash of one block of tokens, with local seed `seed` (see
    /// [`lora_seed`]).
    pub fn local_hash(&mut self, tokens: &[u32], seed: u64) -> u64 {
        self.fill(tokens);
        xxh3_64_with_seed(&self.bytes, seed)
    }

    /// Engine hash of a block given its parent's engine hash id (`None` for the first block)
    /// and the LoRA adapter it was computed with (`None` for the base model).
    pub fn engine_hash(
        &mut self,
        parent: Option<u64>,
        tokens: &[u32],
        lora_name: Option<&str>,
    ) -> EngineHash {
        self.salted_engine_hash(parent, tokens, lora_name, None)
    }

    /// [`BlockHasher::engine_hash`] of a request's block with `cache_salt`, which only the
    /// first block (no parent) carries; `None` or an empty salt is no salt.
    pub fn salted_engine_hash(
        &mut self,
        parent: Option<u64>,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> EngineHash {
        let mut digest = Sha256::new();
        if let Some(parent) = parent {
            digest.update(parent.to_be_bytes());
        }
        self.fill(tokens);
        digest.update(&self.bytes);
        if let Some(name) = lora_name {
            digest.update(name.as_bytes());
        }
        if let Some(salt) = cache_salt.filter(|s| parent.is_none() && !s.is_empty()) {
            digest.update(b"\0cache_salt\0");
            digest.update(salt.as_bytes());
        }
        EngineHash(digest.finalize().into())
    }

    /// Sequence hashes of every full block of `tokens` (a trailing partial block is skipped),
    /// local hashes seeded with `seed` (see [`lora_seed`]).
    pub fn sequence_hashes(&mut self, tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        self.extend_sequence_hashes(tokens, block_size, seed, &mut out);
        out
    }

    /// [`BlockHasher::sequence_hashes`] of a request with `cache_salt`: the first block's
    /// local hash is [`salted_local_hash`]'s (`None` or an empty salt: unsalted).
    pub fn salted_sequence_hashes(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        seed: u64,
        cache_salt: Option<&str>,
    ) -> Vec<u64> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        self.extend_salted_sequence_hashes(tokens, block_size, seed, cache_salt, &mut out);
        out
    }

    /// Appends the sequence hashes of full blocks of `tokens` beyond the `hashes.len()` already
    /// known, chaining onto the last one; local hashes seeded with `seed`.
    pub fn extend_sequence_hashes(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        seed: u64,
        hashes: &mut Vec<u64>,
    ) {
        self.extend_salted_sequence_hashes(tokens, block_size, seed, None, hashes);
    }

    /// [`BlockHasher::extend_sequence_hashes`] of a request with `cache_salt`, which salts
    /// the first block when it is among those hashed here.
    pub fn extend_salted_sequence_hashes(
        &mut self,
        tokens: &[u32],
        block_size: usize,
        seed: u64,
        cache_salt: Option<&str>,
        hashes: &mut Vec<u64>,
    ) {
        if block_size == 0 {
            return;
        }
        let full = tokens.len() / block_size;
        for block in hashes.len()..full {
            let local =
                self.local_hash(&tokens[block * block_size..(block + 1) * block_size], seed);
            let seq = match hashes.last() {
                Some(&parent) => chain_hash(parent, local),
                None => match cache_salt {
                    Some(salt) if !salt.is_empty() => salted_local_hash(local, salt),
                    _ => local,
                },
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
        assert_eq!(
            h.local_hash(&tokens[..16], XXH3_SEED),
            15_310_707_395_893_867_146
        );
        assert_eq!(
            h.local_hash(&tokens[16..], XXH3_SEED),
            15_292_316_782_987_903_195
        );
        assert_eq!(
            h.sequence_hashes(&tokens, 16, XXH3_SEED),
            vec![15_310_707_395_893_867_146, 13_769_157_705_258_532_664]
        );
    }

    #[test]
    fn reference_vectors_block_64() {
        let tokens: Vec<u32> = (0..128).collect();
        let mut h = BlockHasher::new();
        assert_eq!(
            h.sequence_hashes(&tokens, 64, XXH3_SEED),
            vec![3_480_597_578_098_033_343, 2_575_318_956_255_022_795]
        );
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        let tokens: Vec<u32> = (0..40).collect();
        assert_eq!(
            BlockHasher::new()
                .sequence_hashes(&tokens, 16, XXH3_SEED)
                .len(),
            2
        );
    }

    #[test]
    fn extending_matches_hashing_at_once() {
        let tokens: Vec<u32> = (0..100).collect();
        let mut h = BlockHasher::new();
        let mut hashes = h.sequence_hashes(&tokens[..40], 16, XXH3_SEED);
        h.extend_sequence_hashes(&tokens, 16, XXH3_SEED, &mut hashes);
        assert_eq!(hashes, h.sequence_hashes(&tokens, 16, XXH3_SEED));
    }

    #[test]
    fn identical_blocks_at_different_depths_differ() {
        let tokens = vec![7u32; 32];
        let hashes = BlockHasher::new().sequence_hashes(&tokens, 16, XXH3_SEED);
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
        let first = h.engine_hash(None, &tokens, None);
        assert_eq!(first.id(), expected);
        assert_eq!(first.digest()[..], digest[..]);
        assert_ne!(first.id(), h.local_hash(&tokens, XXH3_SEED));
        let child = h.engine_hash(Some(first.id()), &tokens, None);
        assert_ne!(child, first);
        assert_eq!(child, h.engine_hash(Some(first.id()), &tokens, None));
    }

    #[test]
    fn lora_seed_matches_the_kvmesh_rule() {
        // The vectors of kvmesh_kv::lora_seed: the agent re-hashes adapter blocks with them.
        assert_eq!(
            xxh3_64_with_seed(b"my-adapter", 0),
            2_360_313_164_392_601_971
        );
        assert_eq!(lora_seed(Some("my-adapter")), 2_360_313_164_392_603_308);
        assert_eq!(lora_seed(None), XXH3_SEED);
        assert_eq!(lora_seed(Some("")), XXH3_SEED);
        let tokens: Vec<u32> = (0..32).collect();
        let mut h = BlockHasher::new();
        let seed = lora_seed(Some("my-adapter"));
        let hashes = h.sequence_hashes(&tokens, 16, seed);
        assert_eq!(hashes[0], 10_414_274_580_423_718_356);
        // Chaining keeps seed 1337 for adapter blocks too.
        assert_eq!(hashes[1], chain_hash(hashes[0], 12_183_817_081_113_634_636));
    }

    #[test]
    fn cache_salt_matches_the_kvmesh_rule() {
        // The vectors of kvmesh_kv's cache_salt_vectors test: the proxy and the agent salt
        // block hashes with them.
        assert_eq!(CACHE_SALT_SEED.to_be_bytes(), *b"cachesal");
        let tokens: Vec<u32> = (0..32).collect();
        let mut h = BlockHasher::new();
        let salted = h.salted_sequence_hashes(&tokens, 16, XXH3_SEED, Some("tenant-a"));
        assert_eq!(
            salted,
            vec![16_092_681_004_478_993_183, 14_638_022_048_924_065_606]
        );
        assert_eq!(
            salted[0],
            salted_local_hash(15_310_707_395_893_867_146, "tenant-a")
        );
        let plain = h.sequence_hashes(&tokens, 16, XXH3_SEED);
        assert_eq!(
            h.salted_sequence_hashes(&tokens, 16, XXH3_SEED, None),
            plain
        );
        assert_eq!(
            h.salted_sequence_hashes(&tokens, 16, XXH3_SEED, Some("")),
            plain
        );
        // Extending a salted prefix salts nothing more.
        let mut grown = h.salted_sequence_hashes(&tokens[..20], 16, XXH3_SEED, Some("tenant-a"));
        h.extend_salted_sequence_hashes(&tokens, 16, XXH3_SEED, Some("tenant-a"), &mut grown);
        assert_eq!(grown, salted);
        // The engine hash: the first block's input ends with the salt, a child's does not.
        let first = h.salted_engine_hash(None, &tokens[..16], None, Some("tenant-a"));
        let mut bytes: Vec<u8> = tokens[..16].iter().flat_map(|t| t.to_le_bytes()).collect();
        bytes.extend_from_slice(b"\0cache_salt\0tenant-a");
        assert_eq!(first.digest()[..], Sha256::digest(&bytes)[..]);
        assert_ne!(first, h.engine_hash(None, &tokens[..16], None));
        assert_eq!(
            h.salted_engine_hash(Some(first.id()), &tokens[16..], None, Some("tenant-a")),
            h.engine_hash(Some(first.id()), &tokens[16..], None)
        );
    }

    #[test]
    fn adapters_and_the_base_model_never_share_a_hash() {
        let tokens: Vec<u32> = (0..32).collect();
        let mut h = BlockHasher::new();
        let base = h.sequence_hashes(&tokens, 16, lora_seed(None));
        let a = h.sequence_hashes(&tokens, 16, lora_seed(Some("a")));
        let b = h.sequence_hashes(&tokens, 16, lora_seed(Some("b")));
        for i in 0..2 {
            assert!(
                base[i] != a[i] && base[i] != b[i] && a[i] != b[i],
                "block {i}"
            );
        }
        let engine = |h: &mut BlockHasher, lora| h.engine_hash(None, &tokens[..16], lora);
        let (base, a, b) = (
            engine(&mut h, None),
            engine(&mut h, Some("a")),
            engine(&mut h, Some("b")),
        );
        assert!(base != a && base != b && a != b);
        // The adapter's engine hash is SHA-256 over the base input followed by its name.
        let mut bytes: Vec<u8> = tokens[..16].iter().flat_map(|t| t.to_le_bytes()).collect();
        bytes.extend_from_slice(b"a");
        assert_eq!(a.digest()[..], Sha256::digest(&bytes)[..]);
    }
}

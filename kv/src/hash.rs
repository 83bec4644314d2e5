//! Token blocks to block hashes: XXH3-64 local block hashes and prefix-chained sequence hashes.
//!
//! The rules are Dynamo's (see the crate docs): each full block of `block_size` tokens is hashed as
//! its token ids encoded as little-endian `u32`s with seed [`XXH3_SEED`] (or the LoRA seed), a
//! trailing partial block is never hashed, and sequence hashes chain each local hash onto the
//! previous sequence hash. kvmesh adds one rule of its own: a request's `cache_salt` changes the
//! local hash of its first block ([`salted_local_hash`]), and through the chain every block after.

use std::num::NonZeroUsize;

use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

use crate::error::HashError;

/// Seed of every XXH3-64 hash in kvmesh's block-hash space (Dynamo's `XXH3_SEED`).
pub const XXH3_SEED: u64 = 1337;

/// Position-independent hash of one full block of tokens (Dynamo's "tokens hash").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalBlockHash(pub u64);

/// Prefix-chained hash of a block: identifies the block together with every block before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

/// An engine's own opaque id for a cached block (vLLM `block_hashes`), stable per worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExternalHash(pub u64);

impl ExternalHash {
    /// A block's *own id*: its sequence hash as its id, how the worker-agent names blocks.
    /// [`crate::KvIndex`] keeps such an id without an entry in its engine-id table.
    pub fn own(sequence: SequenceHash) -> Self {
        Self(sequence.0)
    }
}

/// The seed for local block hashes of a model or LoRA adapter.
///
/// `None` or an empty name is the base model ([`XXH3_SEED`]); otherwise the seed is
/// `1337 wrapping_add XXH3_64(UTF-8(name), seed 0)`.
pub fn lora_seed(lora_name: Option<&str>) -> u64 {
    match lora_name {
        Some(name) if !name.is_empty() => {
            XXH3_SEED.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0))
        }
        _ => XXH3_SEED,
    }
}

/// Seed of the hash that folds a request's `cache_salt` into its first block
/// ([`salted_local_hash`]): the ASCII bytes `cachesal` read as a big-endian `u64`, a value no
/// other kvmesh hash uses as its seed.
pub const CACHE_SALT_SEED: u64 = 0x6361_6368_6573_616c;

/// The local hash of a sequence's **first** block under the request's `cache_salt`:
/// `XXH3_64(LE_u64(local) ‖ UTF-8(salt), seed` [`CACHE_SALT_SEED`]`)`, where `local` is the
/// block's hash without the salt (LoRA seed and multimodal hashes included).
///
/// This mirrors vLLM, which adds `cache_salt` to the extra keys of the block at token 0 only
/// (`generate_block_hash_extra_keys`); the chain carries it into every later block, so two
/// tenants' copies of one prompt share no block. An empty salt is no salt (vLLM tests the
/// salt's truth); use [`apply_cache_salt`], which skips it.
pub fn salted_local_hash(local: LocalBlockHash, salt: &str) -> LocalBlockHash {
    let mut hasher = Xxh3::with_seed(CACHE_SALT_SEED);
    hasher.update(&local.0.to_le_bytes());
    hasher.update(salt.as_bytes());
    LocalBlockHash(hasher.digest())
}

/// Folds `cache_salt` into `locals[0]`, where `locals` are the local hashes of blocks that
/// **start** a sequence (never of a continuation). `None`, an empty salt or no block leave
/// `locals` as they are, so unsalted prompts hash exactly as without this call.
pub fn apply_cache_salt(locals: &mut [LocalBlockHash], cache_salt: Option<&str>) {
    if let (Some(first), Some(salt)) = (locals.first_mut(), cache_salt)
        && !salt.is_empty()
    {
        *first = salted_local_hash(*first, salt);
    }
}

/// The sequence hash of a block whose local hash is `local`, after the block `parent`
/// (`None` for the first block of a sequence, whose sequence hash is its local hash).
///
/// Always seeded with [`XXH3_SEED`], also for LoRA blocks.
pub fn sequence_hash(parent: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
    match parent {
        None => SequenceHash(local.0),
        Some(parent) => {
            let mut input = [0u8; 16];
            input[..8].copy_from_slice(&parent.0.to_le_bytes());
            input[8..].copy_from_slice(&local.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&input, XXH3_SEED))
        }
    }
}

/// Appends the sequence hashes of `locals` to `out`, chaining from `parent`
/// (the sequence hash of the block before `locals[0]`, or `None` at the start of a sequence).
pub fn extend_sequence_hashes(
    parent: Option<SequenceHash>,
    locals: &[LocalBlockHash],
    out: &mut Vec<SequenceHash>,
) {
    out.reserve(locals.len());
    let mut previous = parent;
    for &local in locals {
        let next = sequence_hash(previous, local);
        out.push(next);
        previous = Some(next);
    }
}

/// The local and sequence hashes of a token sequence's full blocks, index `i` for block `i`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockHashes {
    /// Local (position-independent) hash of each full block.
    pub local: Vec<LocalBlockHash>,
    /// Sequence (prefix-chained) hash of each full block.
    pub sequence: Vec<SequenceHash>,
}

impl BlockHashes {
    /// Number of full blocks.
    pub fn len(&self) -> usize {
        self.sequence.len()
    }

    /// Whether the sequence has no full block.
    pub fn is_empty(&self) -> bool {
        self.sequence.is_empty()
    }

    /// Empties both vectors, keeping their allocations.
    pub fn clear(&mut self) {
        self.local.clear();
        self.sequence.clear();
    }
}

/// Hashes token sequences into blocks for one block size and one model or LoRA adapter.
///
/// Holds scratch buffers, so one hasher per thread avoids per-call allocations; on
/// little-endian targets plain blocks are hashed straight from the token slice.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_size: NonZeroUsize,
    seed: u64,
    bytes: Vec<u8>,
    mm: Vec<u64>,
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens of the base model (`lora_name` `None` or empty)
    /// or of a LoRA adapter.
    pub fn new(block_size: usize, lora_name: Option<&str>) -> Result<Self, HashError> {
        let block_size = NonZeroUsize::new(block_size).ok_or(HashError::ZeroBlockSize)?;
        Ok(Self {
            block_size,
            seed: lora_seed(lora_name),
            bytes: Vec::new(),
            mm: Vec::new(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size.get()
    }

    /// The XXH3 seed used for local hashes (see [`lora_seed`]).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Number of full blocks in `n_tokens` tokens.
    pub fn full_blocks(&self, n_tokens: usize) -> usize {
        n_tokens / self.block_size.get()
    }

    /// Appends the local hash of every full block of `tokens` to `out`.
    pub fn extend_local_hashes(&mut self, tokens: &[u32], out: &mut Vec<LocalBlockHash>) {
        let chunks = tokens.chunks_exact(self.block_size.get());
        out.reserve(chunks.len());
        for block in chunks {
            out.push(self.plain_block_hash(block));
        }
    }

    /// Appends the local hash of every full block of `tokens` to `out`, where block `i` carries
    /// the multimodal object hashes `mm_hashes[i]` (in any order; missing or empty means none).
    ///
    /// A block with objects hashes its token bytes followed by its mm hashes sorted ascending,
    /// each as 8 little-endian bytes.
    pub fn extend_local_hashes_mm<M: AsRef<[u64]>>(
        &mut self,
        tokens: &[u32],
        mm_hashes: &[M],
        out: &mut Vec<LocalBlockHash>,
    ) {
        let chunks = tokens.chunks_exact(self.block_size.get());
        out.reserve(chunks.len());
        for (index, block) in chunks.enumerate() {
            let objects = mm_hashes.get(index).map_or(&[][..], AsRef::as_ref);
            if objects.is_empty() {
                out.push(self.plain_block_hash(block));
                continue;
            }
            self.mm.clear();
            self.mm.extend_from_slice(objects);
            self.mm.sort_unstable();
            self.bytes.clear();
            extend_le_bytes(block, &mut self.bytes);
            for hash in &self.mm {
                self.bytes.extend_from_slice(&hash.to_le_bytes());
            }
            out.push(LocalBlockHash(xxh3_64_with_seed(&self.bytes, self.seed)));
        }
    }

    /// Local and sequence hashes of every full block of `tokens`, written into `out`
    /// (cleared first; its allocations are reused).
    pub fn hash_into(&mut self, tokens: &[u32], out: &mut BlockHashes) {
        self.hash_salted_into(tokens, None, out);
    }

    /// Like [`BlockHasher::hash_into`], for a request with `cache_salt` (vLLM's request field):
    /// the first block's local hash is [`salted_local_hash`]'s, so every sequence hash differs
    /// from the unsalted prompt's. `None` or an empty salt hashes exactly as `hash_into`.
    pub fn hash_salted_into(
        &mut self,
        tokens: &[u32],
        cache_salt: Option<&str>,
        out: &mut BlockHashes,
    ) {
        out.clear();
        self.extend_local_hashes(tokens, &mut out.local);
        apply_cache_salt(&mut out.local, cache_salt);
        extend_sequence_hashes(None, &out.local, &mut out.sequence);
    }

    /// Like [`BlockHasher::hash_into`], with per-block multimodal hashes as in
    /// [`BlockHasher::extend_local_hashes_mm`].
    pub fn hash_mm_into<M: AsRef<[u64]>>(
        &mut self,
        tokens: &[u32],
        mm_hashes: &[M],
        out: &mut BlockHashes,
    ) {
        out.clear();
        self.extend_local_hashes_mm(tokens, mm_hashes, &mut out.local);
        extend_sequence_hashes(None, &out.local, &mut out.sequence);
    }

    /// Local and sequence hashes of every full block of `tokens`.
    pub fn hash(&mut self, tokens: &[u32]) -> BlockHashes {
        self.hash_salted(tokens, None)
    }

    /// Local and sequence hashes of every full block of `tokens` under `cache_salt` (see
    /// [`BlockHasher::hash_salted_into`]).
    pub fn hash_salted(&mut self, tokens: &[u32], cache_salt: Option<&str>) -> BlockHashes {
        let mut out = BlockHashes::default();
        self.hash_salted_into(tokens, cache_salt, &mut out);
        out
    }

    #[cfg(target_endian = "little")]
    fn plain_block_hash(&mut self, block: &[u32]) -> LocalBlockHash {
        LocalBlockHash(xxh3_64_with_seed(le_bytes_in_place(block), self.seed))
    }

    #[cfg(not(target_endian = "little"))]
    fn plain_block_hash(&mut self, block: &[u32]) -> LocalBlockHash {
        self.bytes.clear();
        extend_le_bytes(block, &mut self.bytes);
        LocalBlockHash(xxh3_64_with_seed(&self.bytes, self.seed))
    }
}

/// Appends each token as 4 little-endian bytes (the portable encoding).
fn extend_le_bytes(tokens: &[u32], out: &mut Vec<u8>) {
    out.reserve(tokens.len() * 4);
    for token in tokens {
        out.extend_from_slice(&token.to_le_bytes());
    }
}

/// The tokens' memory seen as bytes, which on a little-endian target is exactly their
/// little-endian encoding.
#[cfg(target_endian = "little")]
fn le_bytes_in_place(tokens: &[u32]) -> &[u8] {
    // SAFETY: the pointer and length describe exactly the initialised memory of `tokens`
    // (`size_of_val` bytes), `u8` has alignment 1 and no invalid bit patterns, and the returned
    // slice borrows `tokens`, so the memory outlives it and is not mutated meanwhile.
    unsafe { std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), size_of_val(tokens)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher(block_size: usize, lora: Option<&str>) -> BlockHasher {
        BlockHasher::new(block_size, lora).expect("non-zero block size")
    }

    fn locals(values: &[u64]) -> Vec<LocalBlockHash> {
        values.iter().copied().map(LocalBlockHash).collect()
    }

    fn seqs(values: &[u64]) -> Vec<SequenceHash> {
        values.iter().copied().map(SequenceHash).collect()
    }

    #[test]
    fn xxh3_seed_vector() {
        assert_eq!(
            xxh3_64_with_seed(b"test data", XXH3_SEED),
            13_226_331_709_069_118_873
        );
    }

    #[test]
    fn base_model_vectors_block_16() {
        let tokens: Vec<u32> = (0..32).collect();
        let hashes = hasher(16, None).hash(&tokens);
        assert_eq!(
            hashes.local,
            locals(&[15_310_707_395_893_867_146, 15_292_316_782_987_903_195])
        );
        assert_eq!(hashes.local[0].0, 0xd47a_8f41_c833_328a);
        assert_eq!(hashes.local[1].0, 0xd439_3917_8abd_00db);
        assert_eq!(
            hashes.sequence,
            seqs(&[15_310_707_395_893_867_146, 13_769_157_705_258_532_664])
        );
    }

    #[test]
    fn lora_vectors() {
        assert_eq!(
            xxh3_64_with_seed(b"my-adapter", 0),
            2_360_313_164_392_601_971
        );
        assert_eq!(lora_seed(Some("my-adapter")), 2_360_313_164_392_603_308);
        let tokens: Vec<u32> = (0..32).collect();
        let hashes = hasher(16, Some("my-adapter")).hash(&tokens);
        assert_eq!(
            hashes.local,
            locals(&[10_414_274_580_423_718_356, 12_183_817_081_113_634_636])
        );
        assert_eq!(hashes.sequence[0].0, hashes.local[0].0);
        assert_eq!(
            hashes.sequence[1],
            sequence_hash(Some(hashes.sequence[0]), hashes.local[1]),
            "sequence hashes use the plain seed also for LoRA blocks"
        );
    }

    #[test]
    fn empty_lora_name_is_base_model() {
        assert_eq!(lora_seed(Some("")), XXH3_SEED);
        assert_eq!(lora_seed(None), XXH3_SEED);
    }

    #[test]
    fn multimodal_vector() {
        let tokens: Vec<u32> = (0..32).collect();
        let mut out = BlockHashes::default();
        hasher(16, None).hash_mm_into(&tokens, &[vec![42u64]], &mut out);
        assert_eq!(
            out.local,
            locals(&[17_296_075_943_456_101_971, 15_292_316_782_987_903_195])
        );
    }

    #[test]
    fn multimodal_hashes_are_sorted_before_hashing() {
        let tokens: Vec<u32> = (0..16).collect();
        let mut h = hasher(16, None);
        let mut a = Vec::new();
        let mut b = Vec::new();
        h.extend_local_hashes_mm(&tokens, &[[7u64, 3, 99]], &mut a);
        h.extend_local_hashes_mm(&tokens, &[[99u64, 7, 3]], &mut b);
        assert_eq!(a, b);
        let mut plain = Vec::new();
        h.extend_local_hashes(&tokens, &mut plain);
        assert_ne!(a, plain);
    }

    #[test]
    fn cache_salt_vectors() {
        let tokens: Vec<u32> = (0..32).collect();
        let mut h = hasher(16, None);
        let plain = h.hash(&tokens);
        let salted = h.hash_salted(&tokens, Some("tenant-a"));
        // Derived with python xxhash: XXH3_64(LE_u64(15310707395893867146) ‖ b"tenant-a",
        // seed 0x636163686573616c). engine-sim asserts the same numbers.
        assert_eq!(salted.local[0].0, 16_092_681_004_478_993_183);
        assert_eq!(
            salted.local[1], plain.local[1],
            "only the first block is salted"
        );
        assert_eq!(salted.sequence[0].0, salted.local[0].0);
        assert_eq!(salted.sequence[1].0, 14_638_022_048_924_065_606);
        assert_ne!(
            salted.sequence[1], plain.sequence[1],
            "the chain carries the salt"
        );
        let mut input = plain.local[0].0.to_le_bytes().to_vec();
        input.extend_from_slice(b"tenant-a");
        assert_eq!(
            salted.local[0].0,
            xxh3_64_with_seed(&input, CACHE_SALT_SEED)
        );
        assert_eq!(CACHE_SALT_SEED.to_be_bytes(), *b"cachesal");
    }

    #[test]
    fn no_salt_and_empty_salt_hash_as_before() {
        let tokens: Vec<u32> = (0..32).collect();
        let mut h = hasher(16, Some("my-adapter"));
        let plain = h.hash(&tokens);
        assert_eq!(h.hash_salted(&tokens, None), plain);
        assert_eq!(h.hash_salted(&tokens, Some("")), plain);
        let mut locals = plain.local.clone();
        apply_cache_salt(&mut locals, Some(""));
        assert_eq!(locals, plain.local);
        apply_cache_salt(&mut [], Some("x"));
    }

    #[test]
    fn different_salts_share_no_block() {
        let tokens: Vec<u32> = (0..64).collect();
        let mut h = hasher(16, None);
        let a = h.hash_salted(&tokens, Some("a"));
        let b = h.hash_salted(&tokens, Some("b"));
        let plain = h.hash(&tokens);
        for i in 0..4 {
            assert_ne!(a.sequence[i], b.sequence[i], "block {i}");
            assert_ne!(a.sequence[i], plain.sequence[i], "block {i}");
        }
        assert_eq!(a, h.hash_salted(&tokens, Some("a")));
        // A LoRA adapter named like the salt is a different namespace.
        let lora = hasher(16, Some("a")).hash(&tokens);
        assert_ne!(a.sequence[0], lora.sequence[0]);
        // A salted prompt that extends another salted prompt shares its prefix.
        let short = h.hash_salted(&tokens[..32], Some("a"));
        assert_eq!(short.sequence[..], a.sequence[..2]);
    }

    #[test]
    fn block_64_vectors() {
        let tokens: Vec<u32> = (0..128).collect();
        let hashes = hasher(64, None).hash(&tokens);
        assert_eq!(
            hashes.local,
            locals(&[3_480_597_578_098_033_343, 3_318_286_205_056_455_972])
        );
        assert_eq!(
            hashes.sequence,
            seqs(&[3_480_597_578_098_033_343, 2_575_318_956_255_022_795])
        );
    }

    #[test]
    fn partial_block_is_not_hashed() {
        let tokens: Vec<u32> = (0..40).collect();
        let mut h = hasher(16, None);
        let hashes = h.hash(&tokens);
        assert_eq!(hashes.len(), 2);
        assert_eq!(h.full_blocks(40), 2);
        assert_eq!(hashes, h.hash(&tokens[..32]));
        assert!(h.hash(&tokens[..15]).is_empty());
    }

    #[test]
    fn zero_block_size_is_an_error() {
        assert!(matches!(
            BlockHasher::new(0, None),
            Err(HashError::ZeroBlockSize)
        ));
    }

    #[test]
    fn in_place_path_matches_portable_encoding() {
        let tokens: Vec<u32> = (0..48).map(|t| t * 0x0101_0101 + 7).collect();
        let mut h = hasher(16, Some("x"));
        let mut fast = Vec::new();
        h.extend_local_hashes(&tokens, &mut fast);
        let portable: Vec<LocalBlockHash> = tokens
            .chunks_exact(16)
            .map(|block| {
                let mut bytes = Vec::new();
                extend_le_bytes(block, &mut bytes);
                LocalBlockHash(xxh3_64_with_seed(&bytes, h.seed()))
            })
            .collect();
        assert_eq!(fast, portable);
    }

    #[test]
    fn local_hash_is_position_independent_sequence_hash_is_not() {
        let block: Vec<u32> = (100..116).collect();
        let tokens: Vec<u32> = block.iter().chain(block.iter()).copied().collect();
        let hashes = hasher(16, None).hash(&tokens);
        assert_eq!(hashes.local[0], hashes.local[1]);
        assert_ne!(hashes.sequence[0], hashes.sequence[1]);
    }

    #[test]
    fn chaining_from_a_parent_continues_a_sequence() {
        let tokens: Vec<u32> = (0..64).collect();
        let full = hasher(16, None).hash(&tokens);
        let mut tail = Vec::new();
        extend_sequence_hashes(Some(full.sequence[1]), &full.local[2..], &mut tail);
        assert_eq!(tail, full.sequence[2..]);
    }

    #[test]
    fn hash_into_reuses_and_clears_the_output() {
        let mut h = hasher(16, None);
        let mut out = h.hash(&(0..64).collect::<Vec<u32>>());
        h.hash_into(&(0..32).collect::<Vec<u32>>(), &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out.local.len(), 2);
    }
}

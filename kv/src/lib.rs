//! kvmesh-kv: block hashing, the KV overlap index and its approximate mode. No I/O, no async.
//!
//! # Hashing ([`BlockHasher`])
//!
//! Dynamo-compatible: each full block of `block_size` tokens is hashed with XXH3-64, seed
//! [`XXH3_SEED`] (1337), over its token ids as little-endian `u32`s (hashed in place on
//! little-endian targets); a trailing partial block is never hashed. A LoRA adapter changes the
//! seed of local hashes ([`lora_seed`]); a block carrying multimodal objects appends their
//! hashes, sorted, as 8-byte little-endian words. A request's `cache_salt` (vLLM's per-request
//! cache namespace) re-hashes the local hash of the sequence's first block only
//! ([`salted_local_hash`]; vLLM also salts only the block at token 0), so the chain carries it
//! into every block; no salt or an empty one changes nothing. Sequence hashes chain each local hash onto the
//! previous sequence hash ([`sequence_hash`]), always with seed 1337. The published test vectors
//! are unit tests of `hash.rs`. Not implemented: Eagle (speculative) windows of `bs + 1` tokens.
//!
//! # The index ([`KvIndex`])
//!
//! ## Keyed by sequence hash
//!
//! A block's identity is its sequence hash, which encodes the whole prefix before it, so the
//! index needs no radix tree: one map from sequence hash to (parent sequence hash, holders).
//! Events therefore carry kvmesh's hashes ([`KvEvent`]): the worker-agent re-hashes each stored
//! block from its tokens and sends, per block, the engine's id ([`ExternalHash`], to address
//! later removals), the local hash and the sequence hash, plus the parent's engine id and
//! sequence hash. The index checks that every block chains from its parent
//! (`sequence_hash(parent, local) == sequence`) and rejects the rest of a chain from the first
//! block that does not (`blocks_invalid`).
//!
//! [`EngineBlockMap`] does that translation from an engine's events (engine ids + token ids),
//! keeping the engine id → sequence hash map it needs to chain a block to its parent.
//!
//! Per worker key ([`WorkerKey`]: instance id, data-parallel rank) the index keeps the engine id
//! → sequence hash map (for removals) and per-block reference counts (a block stays held while
//! any engine id maps to it). An id equal to its block's sequence hash (the block's *own id*, [`ExternalHash::own`])
//! takes no entry in that map, only a bit in the block's counts. The worker-agent names every
//! block so: it keeps the engine's ids itself and sends a block as stored when its first engine
//! id appears and as removed when its last goes, which saves the map's ≈ 20 bytes per
//! (worker, block) pair. Any other ids work as well, at that cost.
//!
//! ## Semantics (Dynamo's §2, without dropping events)
//!
//! - A worker holds a set of blocks. Its match depth for a request is the length of the longest
//!   prefix of the request's blocks that it holds entirely.
//! - Removed drops only the named blocks (no cascade): descendants stay held and match again if
//!   the parent is stored again. A child may list more workers than its parent.
//! - A Stored event whose parent the worker does not hold is **not** thrown away: its blocks are
//!   attached by their sequence hashes (they cannot be misplaced) and stay *orphans* — held but
//!   not matchable past the missing parent — until the parent is stored, when the whole chain
//!   matches at once. The event is counted as `parent_not_found`, which tells the caller to
//!   resynchronise the worker; [`IndexStats::orphan_blocks`] gauges how many blocks wait.
//! - Cleared empties every rank of the instance; `remove_worker` forgets the instance, in two
//!   steps a caller may run apart: `detach_worker` (lookups no longer see it, at once) and
//!   `release_detached` (frees its blocks: a scan of every shard).
//! - Every event returns an [`ApplyOutcome`] (stored, removed, cleared, parent_not_found,
//!   blocks_not_found, blocks_invalid) for metrics; [`ApplyOutcome::status`] gives a per-event
//!   label.
//!
//! ## find_matches in O(k · log n) probes
//!
//! A worker without orphans holds the parent of every block it holds, so along a request the set
//! of workers holding block `i` only shrinks as `i` grows. [`KvIndex::find_matches`] exploits
//! this: it gallops (1, 2, 4, … blocks ahead, then bisects) to the last block that every
//! still-matching worker holds, scores the workers missing from the next block, and continues
//! with the rest; k is the number of distinct depths. Each worker keeps a lock-free orphan
//! counter; a worker with orphans is re-checked block by block, so results are exact in every
//! state, which property tests check against a naive model (`tests/index_model.rs`). The
//! matches come out in worker-key order without a sort: the registry keeps its workers' key
//! order as they register (`index/key_order.rs`), and a lookup places each match at its rank.
//!
//! ## Concurrency: sharded table, one short lock per block operation
//!
//! The block table is split into [`DEFAULT_SHARDS`] (1024) shards by the block's key, each a
//! `std::sync::RwLock` over a compact hash table on its own cache lines. Every read or
//! write holds one shard lock for one table operation, so a lookup never waits for a whole event,
//! let alone a stream of them, writers for different workers run in parallel, and a table
//! resize stalls one small shard only. Per-worker bookkeeping sits behind a per-worker mutex
//! that lookups never take: they read only atomic counters. A block owner's counts sit in the
//! block's slot, under its shard lock, and only that worker's writer changes them (see
//! *Memory*). A lookup concurrent with writes sees each block at some moment during the lookup.
//!
//! Measured on the 2-core development machine in a quiet window, with the `std` hash-map
//! shards this table replaced (`docs/BENCHMARKS.md`, `--bench contention`; the compact table
//! measured the same within noise side by side, on a loaded machine), for a 512-block query over 64 workers and 1M cached blocks while another thread applies
//! events non-stop (p50 / p99 of single calls; idle: ≈ 3.0 / 3.1 µs):
//!
//! | shards | lookup under a writer | writer alone beside it | 2 writers, no reader |
//! |---|---|---|---|
//! | 1 (one global lock) | 16.3 / 36.0 µs | 4.2M block-events/s | 3.7M/s |
//! | 64 | 5.7 / 8.8 µs | 5.4M/s | 11.0M/s |
//! | **1024** | **3.9 / 5.0 µs** | 6.8M/s | 11.2M/s |
//! | 4096 | 3.9 / 7.1 µs | 8.2M/s | 10.8M/s |
//!
//! The lookup's ~100 probes pay a cache miss whenever the writer touched that shard's lock
//! since the last lookup; more shards make that rarer, with no measurable gain past 1024.
//! Without contention `find_matches` takes ≈ 1.3 / 2.3 / 3.1 µs at 8 / 64 / 256 workers, and
//! one core applies ≈ 9 / 13 / 11M block-events/s (Stored + Removed, 1 / 32 / 512 blocks per
//! event), again with the `std` hash maps; side by side on a loaded machine the compact tables
//! apply 32-block events ≈ 20 % faster and execute ≈ 5–6 % more instructions per lookup.
//!
//! Alternatives considered: one global lock (above); RCU or a left-right copy (readers never
//! touch a lock, but every write is applied twice or copied, halving a write path that is the
//! bottleneck under bursts, and memory doubles); `dashmap` (the same sharded `RwLock` design,
//! as a dependency); holding a shard lock for a whole event (fewer lock operations, but a
//! lookup could wait for a 512-block event).
//!
//! ## Memory
//!
//! Every table is an ordered linear-probing table (`index/ordered_table.rs`): slots of a key and
//! a small value with no control bytes and no tombstones, sorted by key so that a hit and a miss
//! both scan a few slots from the key's home, grown by a quarter when 7/8 full (70–88 % full
//! once grown). Keys are the sequence hashes and engine ids under a secret keyed bijection
//! (`index/key_mixer.rs`): all 64 bits are kept, so there are no false matches, and clients
//! cannot aim blocks at one bucket.
//!
//! - Per distinct block: a 24-byte slot in its shard (8-byte key, 8-byte parent key, a 4-byte
//!   holder word: the one holding worker's slot, or an index into the shard's holder sets for
//!   blocks held by several workers, which are 16 bytes, a bitset beyond 3 holders; and the
//!   4-byte counts of the block's *owner*).
//! - Per (worker, block) pair: a worker's counts for a block (engine ids and held children, 15
//!   and 16 bits, and the own-id bit; wider counts live in a side map) live in the block's slot
//!   when the worker owns the block: the first worker to hold a block with no owner owns it
//!   until it lets go. Only the other holders pay a 12-byte slot in their own reference-count
//!   table, so most pairs (a block held by one worker) cost nothing beyond the block. A block
//!   held under an id other than its own also costs a 16-byte slot in the worker's engine-id
//!   table (engine id → block key).
//! - The price: a worker's own table does not list the blocks it owns, so removing or clearing
//!   a worker that owns blocks scans every shard (under read locks; lookups go on), ≈ 5 ms per
//!   million blocks in the index on the benchmark VM, where it used to walk the worker's own
//!   blocks only (≈ 0.45 s against 30 ms at 87M blocks over 1,024 workers).
//!
//! Measured with own ids (`cargo bench -p kvmesh-kv --bench memory`): ≈ 31–35 bytes per
//! distinct block at 0.5–1.4M blocks and at 87M (≈ 1.0–1.15 pairs per block; ≈ 40–46 before
//! owners kept their counts in the block, ≈ 60–70 with an engine-id entry per pair, ≈ 95–135
//! with `std` hash maps); `docs/BENCHMARKS.md` has the tables, and the 100M-block index over
//! 1,024 workers (`KVMESH_MEMORY_BLOCKS`). Entries are deleted when their last holder goes;
//! like any hash map, the tables keep their peak capacity.
//! [`KvIndex::heap_bytes`] sums the tables' allocations (a test holds it to what a counting
//! allocator sees, within 0.5 %); the proxy exports it as `kvmesh_index_bytes`.
//!
//! ## A bound, and eviction past it (optional)
//!
//! [`KvIndex::new`] holds what the events say, without bound. [`KvIndex::with_limits`] with
//! [`IndexLimits::max_blocks`] bounds the number of (worker, block) pairs
//! ([`IndexStats::worker_blocks`]): pairs rather than distinct blocks, because most of the
//! memory is per pair, a pair is what eviction can drop and what a worker's capacity counts,
//! and a bound on pairs bounds distinct blocks as well. A bounded index also keeps, per pair,
//! the engine id in store order (8 bytes, 16 at worst as the queue doubles; stale entries stay
//! below the held blocks plus the other ids mapped plus 1,024, compacted a few entries per
//! event). Past the bound, after a
//! Stored event and outside any worker lock, the index evicts pairs:
//!
//! 1. first from the worker furthest over its own capacity ([`KvIndex::set_worker_capacity`]:
//!    engines report their KV capacity in blocks; a worker holding more is lagging or
//!    misreporting), down to that capacity;
//! 2. then from the least recently used worker: a per-worker clock, stamped when the worker
//!    stores an event and when a lookup matches it (per matched worker one relaxed load, and a
//!    relaxed store when the clock moved since; only in a bounded index). Per worker rather than per block, because that is what a
//!    lookup can refresh without touching the blocks it probed.
//!
//! Within a worker the oldest Stored event's engine ids go first, its deepest block first,
//! each dropped as a Removed event would drop it (a block goes with its last engine id), so
//! the index stays exact for what it keeps: an evicted block is absent, and its held children
//! on that worker become orphans. Deepest first means an event's own chain loses its tail
//! before its head and leaves no orphans; a later event that continued the chain does become
//! orphaned (its blocks wait, exact but unmatchable, until they are evicted in turn or their
//! parent is stored again, and that worker's lookups take the exact block-by-block path).
//! A later Removed for an evicted block counts as `blocks_not_found`, like any unknown block.
//! Work is bounded per
//! `apply`: an event of `n` stored blocks evicts at most [`EVICTION_FACTOR`]` · n` pairs and
//! examines at most twice that many store-order entries, plus one scan of the registered
//! workers per victim chosen; so the index stays at its bound while events arrive (it may
//! stay above it by a few pairs while stale entries use up the examination budget).
//! [`IndexStats::evicted_blocks`] counts evicted pairs. A property test checks a bounded
//! index against the naive model of what it kept (`tests/index_model.rs`).
//!
//! # Approximate mode ([`ApproxIndex`])
//!
//! For engines without KV events: each routing decision records the request's blocks for the
//! chosen worker with a TTL (default 120 s); re-recording refreshes. Expiry is lazy, through a
//! min-heap on (expiry, deepest first); past `max_blocks` (default 2^20) pairs the
//! earliest-expiring ones are pruned down to 0.8 of the bound. The clock is passed in
//! (`Instant`), so tests need no sleeps. Predictions are applied to an inner [`KvIndex`], so
//! lookups are as concurrent as with events. Cost: ≈ 280 bytes per predicted (worker, block)
//! pair, predictions, heap and inner index together (≈ 280 MiB at the default bound).

mod approx;
mod engine_blocks;
mod error;
mod event;
mod hash;
mod index;
mod keyed_hasher;
mod outcome;
mod scores;
mod worker;

pub use approx::{
    ApproxConfig, ApproxIndex, ApproxOutcome, ApproxStats, DEFAULT_MAX_BLOCKS,
    DEFAULT_PRUNE_TARGET_RATIO, DEFAULT_TTL, MAX_TTL,
};
pub use engine_blocks::{EngineBlockMap, TranslateError};
pub use error::{ApproxConfigError, HashError};
pub use event::{BlockParent, KvEvent, StoredBlock};
pub use hash::{
    BlockHasher, BlockHashes, CACHE_SALT_SEED, ExternalHash, LocalBlockHash, SequenceHash,
    XXH3_SEED, apply_cache_salt, extend_sequence_hashes, lora_seed, salted_local_hash,
    sequence_hash,
};
pub use index::{
    DEFAULT_SHARDS, DetachedWorker, EVICTION_FACTOR, IndexLimits, IndexStats, KvIndex,
};
pub use keyed_hasher::{KeyedHasher, KeyedState};
pub use outcome::{ApplyOutcome, ApplyStatus};
pub use scores::{OverlapScores, WorkerOverlap};
pub use worker::{CacheTier, WorkerKey};

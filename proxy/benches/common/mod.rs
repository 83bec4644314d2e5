//! Workload pieces shared by the proxy's benchmarks: deterministic prose and the Qwen3
//! tokenizer.

use std::path::PathBuf;

/// Common words, so the text tokenizes like prose (about 1.3 tokens per word).
const WORDS: &[&str] = &[
    "the",
    "request",
    "router",
    "engine",
    "cache",
    "prefix",
    "block",
    "token",
    "latency",
    "load",
    "and",
    "of",
    "to",
    "in",
    "is",
    "that",
    "with",
    "for",
    "on",
    "as",
    "we",
    "replica",
    "decode",
    "prefill",
    "hash",
    "tree",
    "score",
    "policy",
    "queue",
    "stream",
    "response",
    "model",
    "user",
    "system",
    "message",
    "template",
    "throughput",
    "GPU",
    "memory",
    "page",
    "eviction",
];

/// Deterministic prose of `words` words: mostly common words, some numbers.
pub fn prose(seed: u64, words: usize) -> String {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005) | 1;
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let r = (state >> 33) as usize;
        if r.is_multiple_of(11) {
            out.push_str(&(r % 100_000).to_string());
        } else {
            out.push_str(WORDS[r % WORDS.len()]);
        }
        out.push_str(if i % 23 == 22 { ".\n" } else { " " });
    }
    out
}

/// The Qwen3 tokenizer directory: `$KVMESH_QWEN3_TOKENIZER` or `.cache/tokenizers/qwen3`.
pub fn tokenizer_dir() -> PathBuf {
    let dir = std::env::var_os("KVMESH_QWEN3_TOKENIZER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3")
        });
    assert!(
        dir.join("tokenizer.json").is_file(),
        "the Qwen3 tokenizer is missing from {}: run scripts/fetch-tokenizer.sh",
        dir.display()
    );
    dir
}

//! Chat preprocessing latency with the Qwen3 tokenizer: parse the request body, render the chat
//! template, tokenize; for conversations of about 1k, 8k and 32k prompt tokens. Encoding and
//! the total are measured with the native encoder and with Hugging Face `tokenizers`, in the
//! same run.
//!
//! Needs `scripts/fetch-tokenizer.sh` (or `KVMESH_QWEN3_TOKENIZER`). Run with
//! `cargo bench -p kvmesh-preprocess --bench chat`.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvmesh_preprocess::{ChatRequest, EncoderKind, EncoderPreference, ModelPreprocessor};

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
    "p99",
    "GPU",
    "memory",
    "page",
    "eviction",
];
const SYLLABLES: &[&str] = &[
    "ka", "zu", "mer", "tion", "pre", "lo", "vin", "dra", "qu", "el", "sto", "ny", "bre", "ax",
];

/// Deterministic prose: mostly common words, some invented words, numbers and code.
fn prose(seed: u64, words: usize) -> String {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    let mut out = String::new();
    for i in 0..words {
        let r = next();
        match r % 10 {
            0 => {
                for _ in 0..2 + r % 3 {
                    out.push_str(SYLLABLES[next() % SYLLABLES.len()]);
                }
            }
            1 => out.push_str(&format!("{}", next() % 100_000)),
            2 if r % 7 == 0 => out.push_str(&format!("fn_{}(x)", WORDS[next() % WORDS.len()])),
            _ => out.push_str(WORDS[next() % WORDS.len()]),
        }
        out.push_str(if i % 23 == 22 { ".\n" } else { " " });
    }
    out
}

fn body(messages: &[serde_json::Value]) -> String {
    serde_json::json!({"model": "qwen3", "messages": messages}).to_string()
}

/// A multi-turn conversation (ending with a user turn) of about `target_tokens` prompt tokens.
fn conversation(
    model: &ModelPreprocessor,
    target_tokens: usize,
) -> (Vec<serde_json::Value>, usize) {
    let mut messages = vec![serde_json::json!({"role": "system", "content": prose(1, 60)})];
    let mut turn = 0u64;
    loop {
        let role = if turn.is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        messages.push(serde_json::json!({"role": role, "content": prose(turn + 2, 150)}));
        turn += 1;
        if role == "user" {
            let body = body(&messages);
            let request = ChatRequest::from_slice(body.as_bytes()).expect("body parses");
            let tokens = model.chat_token_ids(&request).expect("preprocess").len();
            if tokens >= target_tokens {
                return (messages, tokens);
            }
        }
    }
}

/// The conversation's next request: an assistant answer and a new user turn appended.
fn next_turn(history: &[serde_json::Value], seed: u64) -> String {
    let mut messages = history.to_vec();
    messages.push(serde_json::json!({"role": "assistant", "content": prose(seed, 300)}));
    messages.push(serde_json::json!({"role": "user", "content": prose(seed + 1, 100)}));
    body(&messages)
}

fn load_model(encoder: EncoderPreference) -> ModelPreprocessor {
    let dir = std::env::var_os("KVMESH_QWEN3_TOKENIZER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3")
        });
    ModelPreprocessor::from_dir_with_encoder(&dir, encoder).unwrap_or_else(|e| {
        panic!(
            "cannot load the Qwen3 tokenizer from {}: {e}; run scripts/fetch-tokenizer.sh",
            dir.display()
        )
    })
}

fn chat(c: &mut Criterion) {
    let model = load_model(EncoderPreference::Auto);
    assert_eq!(model.encoder(), EncoderKind::Native);
    let huggingface = load_model(EncoderPreference::HuggingFace);
    let cached = load_model(EncoderPreference::Auto).with_segment_cache(4_000_000);
    assert!(cached.segment_cache_enabled());
    let mut seed = 1_000_000u64;
    let mut group = c.benchmark_group("chat");
    for (label, target) in [("1k", 1_000), ("8k", 8_000), ("32k", 32_000)] {
        let (history, tokens) = conversation(&model, target);
        let body = body(&history);
        let request = ChatRequest::from_slice(body.as_bytes()).expect("body parses");
        let rendered = model.render_chat(&request).expect("render");
        assert_eq!(
            model.encode_chat(&rendered).expect("encode"),
            huggingface.encode_chat(&rendered).expect("encode"),
            "the encoders disagree"
        );
        group.throughput(Throughput::Elements(tokens as u64));
        let id = |stage: &str| BenchmarkId::new(stage, format!("{label} ({tokens} tokens)"));
        group.bench_function(id("parse+render"), |b| {
            b.iter(|| {
                let request = ChatRequest::from_slice(black_box(body.as_bytes())).expect("parse");
                model.render_chat(&request).expect("render")
            })
        });
        for (encoder, m) in [("native", &model), ("huggingface", &huggingface)] {
            group.bench_function(id(&format!("encode, {encoder}")), |b| {
                b.iter(|| m.encode_chat(black_box(&rendered)).expect("encode"))
            });
            group.bench_function(id(&format!("total, {encoder}")), |b| {
                b.iter(|| {
                    let request =
                        ChatRequest::from_slice(black_box(body.as_bytes())).expect("parse");
                    m.chat_token_ids(&request).expect("preprocess")
                })
            });
        }
        // The next request of the same conversation: history seen before, new turns not.
        let history_body = body.clone();
        let request = ChatRequest::from_slice(history_body.as_bytes()).expect("parse");
        cached.chat_token_ids(&request).expect("warm the cache");
        for (stage, m) in [
            ("next turn, native", &model),
            ("next turn, native + segment cache", &cached),
        ] {
            group.bench_function(id(stage), |b| {
                b.iter_batched(
                    || {
                        seed += 2;
                        next_turn(&history, seed)
                    },
                    |body| {
                        let request = ChatRequest::from_slice(body.as_bytes()).expect("parse");
                        m.chat_token_ids(&request).expect("preprocess")
                    },
                    BatchSize::SmallInput,
                )
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    targets = chat
}
criterion_main!(benches);

//! The full `policy: kv` routing decision — template, tokenize, hash, lookup, score, then book
//! and record — for an ~8k-token chat prompt over 8 instances whose approximate index already
//! holds 32 such conversations, and for a ~128k-token chat prompt never seen before (block
//! size 64).
//!
//! Needs `scripts/fetch-tokenizer.sh`. Run with `cargo bench -p kvmesh-proxy --bench route`.
//! After criterion's groups it prints the p50 per stage of 200 single decisions per case
//! (criterion reports means of batches). Results: `docs/BENCHMARKS.md`.

mod common;

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{BatchSize, Criterion};
use kvmesh_config::KvRoutingConfig;
use kvmesh_proxy::bench_support::{RouteBench, StageSplit};

const INSTANCES: usize = 8;
const WARM_CONVERSATIONS: u64 = 32;
/// Single decisions per case in the percentile pass.
const SAMPLES: usize = 200;
/// Single decisions of the ~128k-token case.
const LONG_SAMPLES: usize = 30;
/// Words of the ~128k-token conversation (≈ 1.3 tokens per word).
const LONG_WORDS: usize = 85_000;

/// A conversation of about 8k tokens: a system prompt and 9 turns, as JSON messages.
fn history(seed: u64) -> Vec<serde_json::Value> {
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": common::prose(seed, 500)})];
    for turn in 0..9u64 {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let content = common::prose(seed * 100 + turn + 1, 560);
        messages.push(serde_json::json!({"role": role, "content": content}));
    }
    messages
}

/// A conversation of about 128k tokens: a system prompt and 9 turns of ≈ 10k words each.
fn long_history(seed: u64) -> Vec<serde_json::Value> {
    let turn_words = LONG_WORDS / 10;
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": common::prose(seed, turn_words)})];
    for turn in 0..9u64 {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        let content = common::prose(seed * 100 + turn + 1, turn_words);
        messages.push(serde_json::json!({"role": role, "content": content}));
    }
    messages
}

fn body(messages: &[serde_json::Value]) -> Bytes {
    Bytes::from(serde_json::json!({"model": "qwen3", "messages": messages}).to_string())
}

/// The conversation's next request: an answer and a new question appended.
fn next_turn(history: &[serde_json::Value], seed: u64) -> Bytes {
    let mut messages = history.to_vec();
    messages.push(serde_json::json!({"role": "assistant", "content": common::prose(seed, 200)}));
    messages.push(serde_json::json!({"role": "user", "content": common::prose(seed + 1, 60)}));
    body(&messages)
}

fn token_ids_body(seed: u32, tokens: u32) -> Bytes {
    let ids: Vec<u32> = (0..tokens)
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i) % 150_000)
        .collect();
    Bytes::from(serde_json::json!({"model": "qwen3", "prompt": ids}).to_string())
}

fn warmed() -> (RouteBench, Vec<Vec<serde_json::Value>>) {
    let dir = common::tokenizer_dir();
    let bench =
        RouteBench::new(&KvRoutingConfig::default(), Some(&dir), INSTANCES).expect("router");
    let conversations: Vec<_> = (1..=WARM_CONVERSATIONS).map(history).collect();
    for conversation in &conversations {
        let (chosen, _) = bench.route_chat(&body(conversation));
        assert!(chosen.is_some(), "every warm-up request is routed");
        bench.route_completion(&token_ids_body(conversation.len() as u32, 8192));
    }
    (bench, conversations)
}

fn route(c: &mut Criterion) {
    let (bench, conversations) = warmed();
    let mut seed = 1_000_000u64;
    let mut group = c.benchmark_group("route");
    group.bench_function("chat ~8k, next turn (history cached)", |b| {
        b.iter_batched(
            || {
                seed += 2;
                next_turn(&conversations[(seed % WARM_CONVERSATIONS) as usize], seed)
            },
            |body| bench.route_chat(&body),
            BatchSize::SmallInput,
        )
    });
    group.bench_function("chat ~8k, cold (unseen text)", |b| {
        b.iter_batched(
            || {
                seed += 1;
                body(&history(seed))
            },
            |body| bench.route_chat(&body),
            BatchSize::SmallInput,
        )
    });
    group.bench_function("completions, 8192 token ids", |b| {
        b.iter_batched(
            || {
                seed += 1;
                token_ids_body(seed as u32, 8192)
            },
            |body| bench.route_completion(&body),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

fn percentile(mut values: Vec<Duration>, p: f64) -> Duration {
    values.sort_unstable();
    let at = ((values.len() as f64 - 1.0) * p).round() as usize;
    values.get(at).copied().unwrap_or_default()
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn report(label: &str, splits: &[StageSplit], tokens: &str) {
    let stage = |f: fn(&StageSplit) -> Duration| percentile(splits.iter().map(f).collect(), 0.5);
    let totals: Vec<Duration> = splits.iter().map(StageSplit::total).collect();
    println!(
        "| {label} | {tokens} | {} | {} | {} | {} | {} | {} | {} | {} |",
        us(stage(|s| s.template)),
        us(stage(|s| s.tokenize)),
        us(stage(|s| s.hash)),
        us(stage(|s| s.lookup)),
        us(stage(|s| s.score)),
        us(stage(|s| s.commit)),
        us(percentile(totals.clone(), 0.5)),
        us(percentile(totals, 0.9)),
    );
}

/// Single decisions, timed stage by stage.
fn split_pass() {
    let (bench, conversations) = warmed();
    println!("\nstage p50 over {SAMPLES} single decisions ({INSTANCES} instances, warm index):\n");
    println!(
        "| case | prompt | template | tokenize | hash | lookup | score | commit | total p50 | total p90 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let tokens = |splits: &[StageSplit]| {
        let median = percentile(
            splits
                .iter()
                .map(|s| Duration::from_nanos(s.prompt_tokens as u64))
                .collect(),
            0.5,
        );
        format!("{} tokens", median.as_nanos())
    };
    let mut splits = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES as u64 {
        let body = next_turn(
            &conversations[(i % WARM_CONVERSATIONS) as usize],
            5_000_000 + 2 * i,
        );
        let (chosen, split) = bench.route_chat(&body);
        black_box(chosen);
        splits.push(split);
    }
    report(
        "chat, next turn (history cached)",
        &splits,
        &tokens(&splits),
    );
    splits.clear();
    for i in 0..SAMPLES as u64 {
        let (_, split) = bench.route_chat(&body(&history(9_000_000 + i)));
        splits.push(split);
    }
    report("chat, cold", &splits, &tokens(&splits));
    splits.clear();
    for i in 0..SAMPLES as u32 {
        let (_, split) = bench.route_completion(&token_ids_body(7_000 + i, 8192));
        splits.push(split);
    }
    report("completions, token ids", &splits, &tokens(&splits));
    splits.clear();
    let config = KvRoutingConfig {
        block_size: Some(64),
        ..KvRoutingConfig::default()
    };
    let long = RouteBench::new(&config, Some(&common::tokenizer_dir()), INSTANCES).expect("router");
    let bodies: Vec<Bytes> = (0..LONG_SAMPLES as u64)
        .map(|i| body(&long_history(40_000_000 + i)))
        .collect();
    for body in &bodies {
        let (chosen, split) = long.route_chat(body);
        assert!(chosen.is_some(), "the long prompt is routed");
        splits.push(split);
    }
    report("chat, cold, block 64", &splits, &tokens(&splits));
    let decisions: Vec<Duration> = splits.iter().map(|s| s.total() - s.commit).collect();
    println!(
        "\n~128k-token cold chat, body to instance chosen (without commit): p50 {} p90 {}",
        us(percentile(decisions.clone(), 0.5)),
        us(percentile(decisions, 0.9))
    );
}

fn main() {
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20)
        .configure_from_args();
    route(&mut criterion);
    criterion.final_summary();
    split_pass();
}

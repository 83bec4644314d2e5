//! Smoke test of the routing-quality harness: `kvmesh-bench` replays the committed Mooncake
//! trace slice and runs a small synthetic chat workload through `kvmesh-proxy` (`policy: kv`)
//! over four `kvmesh-engine-sim` engines, all real processes, in a few seconds. It checks that
//! the report is produced and sane, so the harness keeps working; the full comparison
//! (`benches/routing-quality.sh`) is a benchmark, not a test.
//!
//! Needs `kvmesh-bench` built beside the other binaries (`cargo build --workspace --bins`) and,
//! for the chat part, the Qwen3 tokenizer fetched by `scripts/fetch-tokenizer.sh` (or
//! `KVMESH_QWEN3_TOKENIZER` naming a directory with the same files).

use std::path::{Path, PathBuf};
use std::process::Command;

use kvmesh_e2e::cluster::{engine_urls, proxy_config, start_engines, start_proxy};
use kvmesh_e2e::process::bin_dir;
use kvmesh_e2e::{ScratchDir, Spawned};
use serde_json::Value;

const ENGINES: usize = 4;
/// Requests of the trace slice replayed (the committed file has 200).
const TRACE_REQUESTS: u64 = 24;
/// Conversations × turns of the chat workload.
const CHAT_SESSIONS: u64 = 8;
const CHAT_TURNS: u64 = 3;

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tokenizer_dir() -> PathBuf {
    let dir = match std::env::var_os("KVMESH_QWEN3_TOKENIZER") {
        Some(dir) => PathBuf::from(dir),
        None => workspace_root().join(".cache/tokenizers/qwen3"),
    };
    assert!(
        dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file(),
        "the Qwen3 tokenizer is missing from {}: run scripts/fetch-tokenizer.sh \
         (or set KVMESH_QWEN3_TOKENIZER to a directory holding tokenizer.json and tokenizer_config.json)",
        dir.display()
    );
    dir
}

/// Four engines (timing model sped up 50×, so the run takes seconds but requests still
/// overlap) and a KV-aware proxy in front; `tokenizer` for chat prompts.
fn cluster(scratch: &ScratchDir, tokenizer: Option<&Path>) -> (Spawned, Spawned, Vec<String>) {
    let mut sim_args = vec!["--speedup-ratio", "50"];
    let tokenizer_json = tokenizer.map(|dir| dir.join("tokenizer.json").display().to_string());
    if let Some(file) = &tokenizer_json {
        sim_args.extend(["--tokenizer", file.as_str()]);
    }
    let sims = start_engines(scratch, ENGINES, &sim_args).expect("engine-sims");
    let engines = engine_urls(&sims);
    assert_eq!(engines.len(), ENGINES);
    let mut policy = String::from("policy: kv");
    if let Some(dir) = tokenizer {
        policy.push_str(&format!("\n    tokenizer: {}", dir.display()));
    }
    let config = proxy_config(&engines, "").replace("policy: round_robin", &policy);
    let proxy = start_proxy(scratch, &config).expect("proxy");
    (sims, proxy, engines)
}

/// Runs `kvmesh-bench` with `args` and returns its JSON report.
fn bench(scratch: &ScratchDir, args: &[String]) -> Value {
    let exe = bin_dir().join("kvmesh-bench");
    assert!(
        exe.exists(),
        "{} not found: build the workspace binaries first (cargo build --workspace --bins)",
        exe.display()
    );
    let json = scratch.path().join("report.json");
    let output = Command::new(&exe)
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run kvmesh-bench");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "kvmesh-bench failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("prefix cache: fleet hit rate"), "{stdout}");
    let text = std::fs::read_to_string(&json).expect("JSON report written");
    serde_json::from_str(&text).expect("JSON report parses")
}

fn common_args(proxy: &Spawned, engines: &[String]) -> Vec<String> {
    [
        "--url",
        &proxy.url("main"),
        "--stream",
        "--timeout",
        "60s",
        "--engine-metrics",
        &engines.join(","),
        "--oracle-engines",
        &ENGINES.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn number(report: &Value, pointer: &str) -> f64 {
    report
        .pointer(pointer)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("{pointer} missing from the report: {report:#}"))
}

/// The checks every report must pass: all requests answered, latencies and throughput
/// present, hit rates in [0, 1], the oracle at least what the engines reached, and the
/// engines' prompt tokens equal to the oracle's (it tokenized the prompts as they did).
fn assert_sane(report: &Value, requests: u64) {
    assert_eq!(
        number(report, "/requests_ok"),
        requests as f64,
        "{report:#}"
    );
    assert_eq!(number(report, "/errors_total"), 0.0, "{report:#}");
    assert!(number(report, "/requests_per_s") > 0.0);
    assert!(number(report, "/output_tokens_per_s") > 0.0);
    for metric in ["ttft_ms", "itl_ms", "e2e_ms"] {
        let p50 = number(report, &format!("/{metric}/p50"));
        let p99 = number(report, &format!("/{metric}/p99"));
        assert!(p50 >= 0.0 && p99 >= p50, "{metric}: p50 {p50}, p99 {p99}");
    }
    assert!(number(report, "/ttft_ms/p50") > 0.0);
    let cdf = report["ttft_cdf_ms"].as_array().expect("TTFT CDF points");
    assert!(cdf.len() > 100);

    let engines = report["cache"]["engines"].as_array().expect("engines");
    assert_eq!(engines.len(), ENGINES);
    let served: f64 = engines.iter().map(|e| number(e, "/requests")).sum();
    assert_eq!(served, requests as f64, "every request reached an engine");
    for engine in engines {
        let rate = number(engine, "/hit_rate");
        assert!((0.0..=1.0).contains(&rate), "engine hit rate {rate}");
    }
    let measured = number(report, "/cache/hit_rate");
    let oracle = number(report, "/cache/oracle/hit_rate");
    let infinite = number(report, "/cache/oracle/infinite_hit_rate");
    assert!((0.0..=1.0).contains(&measured), "fleet hit rate {measured}");
    assert!((0.0..=1.0).contains(&oracle), "oracle hit rate {oracle}");
    assert!(measured > 0.0, "the workload shares prefixes: {report:#}");
    assert!(
        oracle >= measured && infinite >= oracle,
        "measured {measured} ≤ oracle {oracle} ≤ infinite {infinite}"
    );
    if number(report, "/cache/preemptions") == 0.0 {
        assert_eq!(
            number(report, "/cache/query_tokens"),
            number(report, "/cache/oracle/prompt_tokens"),
            "the oracle counts prompt tokens as the engines do"
        );
    }
}

#[test]
fn trace_replay_reports_latencies_hit_rates_and_the_oracle() {
    let scratch = ScratchDir::new("bench-trace").expect("scratch dir");
    let (_sims, proxy, engines) = cluster(&scratch, None);
    let trace = workspace_root().join("benches/data/conversation_trace_head200.jsonl");
    let mut args = common_args(&proxy, &engines);
    args.extend(
        [
            "--workload",
            "trace",
            "--trace",
            &trace.display().to_string(),
            "--slice-requests",
            &TRACE_REQUESTS.to_string(),
            "--time-scale",
            "20",
        ]
        .map(String::from),
    );
    let report = bench(&scratch, &args);
    assert_sane(&report, TRACE_REQUESTS);
    assert_eq!(report["workload"]["kind"], "trace");
    assert_eq!(number(&report, "/workload/requests"), TRACE_REQUESTS as f64);
    assert!(number(&report, "/workload/mean_input_tokens") > 1000.0);
}

#[test]
fn synthetic_chat_reports_latencies_hit_rates_and_the_oracle() {
    let tokenizer = tokenizer_dir();
    let scratch = ScratchDir::new("bench-chat").expect("scratch dir");
    let (_sims, proxy, engines) = cluster(&scratch, Some(&tokenizer));
    let mut args = common_args(&proxy, &engines);
    args.extend(
        [
            "--workload",
            "chat",
            "--rate",
            "40",
            "--chat-sessions",
            &CHAT_SESSIONS.to_string(),
            "--chat-active-sessions",
            "4",
            "--chat-turns",
            &CHAT_TURNS.to_string(),
            "--chat-system-prompts",
            "2",
            "--chat-system-words",
            "400",
            "--max-tokens",
            "8",
            "--tokenizer",
            &tokenizer.display().to_string(),
        ]
        .map(String::from),
    );
    let report = bench(&scratch, &args);
    assert_sane(&report, CHAT_SESSIONS * CHAT_TURNS);
    assert_eq!(report["workload"]["kind"], "chat");
}

/// `kvmesh-engine-cache` (the counters around AIPerf in the routing-quality harness) reads the
/// same engine counters as `kvmesh-bench` does around its own load: wrapped around a
/// `kvmesh-bench` replay of the trace's later part (`--skip-seconds`), it counts exactly the
/// requests and prompt tokens the replay's own report counts. A failing command gives its
/// status and writes nothing.
#[test]
fn engine_cache_counts_what_a_wrapped_load_generator_sent() {
    let scratch = ScratchDir::new("bench-engine-cache").expect("scratch dir");
    let (_sims, proxy, engines) = cluster(&scratch, None);
    let trace = workspace_root().join("benches/data/conversation_trace_head200.jsonl");
    let report = scratch.path().join("report.json");
    let cache = scratch.path().join("cache.json");
    let mut bench_args = common_args(&proxy, &engines);
    bench_args.extend(
        [
            "--workload",
            "trace",
            "--trace",
            &trace.display().to_string(),
            "--skip-seconds",
            "36s",
            "--slice-requests",
            &TRACE_REQUESTS.to_string(),
            "--time-scale",
            "20",
            "--json",
            &report.display().to_string(),
        ]
        .map(String::from),
    );
    let wrapper = bin_dir().join("kvmesh-engine-cache");
    let status = Command::new(&wrapper)
        .arg("--engine-metrics")
        .arg(engines.join(","))
        .arg("--json")
        .arg(&cache)
        .arg("--")
        .arg(bin_dir().join("kvmesh-bench"))
        .args(&bench_args)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run kvmesh-engine-cache");
    assert!(status.success(), "kvmesh-engine-cache: {status}");
    let read = |path: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).expect("JSON written"))
            .expect("JSON parses")
    };
    let (report, cache) = (read(&report), read(&cache));
    assert_eq!(number(&report, "/workload/skipped_s"), 36.0);
    assert_eq!(number(&report, "/workload/requests"), TRACE_REQUESTS as f64);
    let served: f64 = cache["engines"]
        .as_array()
        .expect("engines")
        .iter()
        .map(|e| number(e, "/requests"))
        .sum();
    assert_eq!(served, TRACE_REQUESTS as f64, "{cache:#}");
    for counter in ["query_tokens", "hit_tokens", "preemptions"] {
        assert_eq!(
            number(&cache, &format!("/{counter}")),
            number(&report, &format!("/cache/{counter}")),
            "{counter}"
        );
    }
    assert!(cache["oracle"].is_null());

    let missing = scratch.path().join("never.json");
    let status = Command::new(&wrapper)
        .arg("--engine-metrics")
        .arg(engines.join(","))
        .arg("--json")
        .arg(&missing)
        .args(["--", "sh", "-c", "exit 3"])
        .status()
        .expect("run kvmesh-engine-cache");
    assert_eq!(status.code(), Some(3));
    assert!(!missing.exists());
}

//! The proxy compares its tokenizer and chat template with each engine's `/tokenize` once
//! the engine registers: two `kvmesh-engine-sim` processes behind a `policy: kv` proxy with
//! the Qwen3 tokenizer, one tokenizing with the same `tokenizer.json` (agrees), one with the
//! simulator's built-in word tokenizer (its ids differ from the first token on). The second
//! is reported: a WARN, `kvmesh_route_tokenizer_mismatch` 1, admin `/health` `degraded`
//! naming it (still 200), and `; tokenizer_mismatch=<probe>` in the `x-kvmesh-route` of what
//! it served.
//!
//! Needs the tokenizer fetched by `scripts/fetch-tokenizer.sh`, or
//! `KVMESH_QWEN3_TOKENIZER` naming a directory with the same files.

use std::path::PathBuf;
use std::time::Duration;

use kvmesh_e2e::cluster::{
    MODEL, chat_body, engine_urls, proxy_config, start_engines, start_proxy,
};
use kvmesh_e2e::control_plane::await_metric;
use kvmesh_e2e::{HttpClient, ScratchDir};
use tokio::time::Instant;

/// How long the checks may take (both engines answer at once; this bounds a slow CI).
const CHECKED: Duration = Duration::from_secs(20);

fn tokenizer_dir() -> PathBuf {
    let dir = match std::env::var_os("KVMESH_QWEN3_TOKENIZER") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3"),
    };
    assert!(
        dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file(),
        "the Qwen3 tokenizer is missing from {}: run scripts/fetch-tokenizer.sh",
        dir.display()
    );
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_tokenizes_otherwise_is_found_and_reported() {
    let tokenizer = tokenizer_dir();
    let engine_tokenizer = tokenizer.join("tokenizer.json").display().to_string();
    let scratch = ScratchDir::new("tokenizer-check").unwrap();
    let client = HttpClient::http1();
    let same = start_engines(
        &scratch,
        1,
        &["--no-delay", "--tokenizer", &engine_tokenizer],
    )
    .unwrap();
    let other = start_engines(&scratch, 1, &["--no-delay"]).unwrap();
    let (same_url, other_url) = (engine_urls(&same).remove(0), engine_urls(&other).remove(0));
    let config = proxy_config(&[same_url.clone(), other_url.clone()], "").replace(
        "policy: round_robin",
        &format!("policy: kv\n    tokenizer: \"{}\"", tokenizer.display()),
    );
    let proxy = start_proxy(&scratch, &config).unwrap();
    let metrics = format!("{}/metrics", proxy.url("admin"));

    let checks = |outcome: &str| {
        format!("kvmesh_route_tokenizer_checks_total{{model=\"{MODEL}\",outcome=\"{outcome}\"}}")
    };
    await_metric(&client, &metrics, &checks("agreed"), |v| v == 1.0, CHECKED)
        .await
        .unwrap();
    await_metric(
        &client,
        &metrics,
        &checks("mismatched"),
        |v| v == 1.0,
        CHECKED,
    )
    .await
    .unwrap();
    let gauge = |url: &str| {
        format!("kvmesh_route_tokenizer_mismatch{{instance=\"{url}\",model=\"{MODEL}\"}}")
    };
    await_metric(&client, &metrics, &gauge(&other_url), |v| v == 1.0, CHECKED)
        .await
        .unwrap();
    await_metric(&client, &metrics, &gauge(&same_url), |v| v == 0.0, CHECKED)
        .await
        .unwrap();

    // Readiness is unchanged; the model is degraded, naming the engine and the probe.
    let health = client
        .get(&format!("{}/health", proxy.url("admin")))
        .await
        .unwrap();
    let body = health.json().unwrap();
    assert_eq!(
        (health.status, &body["status"]),
        (200, &"degraded".into()),
        "{body}"
    );
    let reasons = body["degraded"].to_string();
    assert!(
        reasons.contains(&other_url) && reasons.contains("text probe"),
        "{body}"
    );
    assert!(!reasons.contains(&same_url), "{body}");
    let instances = body["models"][0]["instances"].as_array().unwrap();
    let entry = |url: &str| {
        instances
            .iter()
            .find(|i| {
                i["url"]
                    .as_str()
                    .is_some_and(|u| u.trim_end_matches('/') == url)
            })
            .unwrap_or_else(|| panic!("{url} not in {body}"))
    };
    assert_eq!(entry(&same_url)["tokenizer_check"], "agreed", "{body}");
    assert_eq!(entry(&other_url)["tokenizer_check"], "mismatched", "{body}");
    assert_eq!(
        entry(&other_url)["tokenizer_mismatch"]["probe"],
        "text",
        "{body}"
    );
    assert_eq!(
        entry(&other_url)["tokenizer_mismatch"]["position"],
        0,
        "{body}"
    );

    // What the mismatched engine serves says so in its explanation; the other's does not.
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    let (mut noted, mut plain) = (false, false);
    let deadline = Instant::now() + CHECKED;
    for i in 0.. {
        let reply = client
            .post_json(&url, &chat_body(&format!("question {i}"), 1, false))
            .await
            .unwrap();
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let route = reply
            .header("x-kvmesh-route")
            .unwrap_or_default()
            .to_string();
        if reply.header("x-kvmesh-instance") == Some(other_url.as_str()) {
            assert!(route.ends_with("; tokenizer_mismatch=text"), "{route}");
            noted = true;
        } else {
            assert!(!route.contains("tokenizer_mismatch"), "{route}");
            plain = true;
        }
        if noted && plain {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never served by both engines (noted {noted}, plain {plain})"
        );
    }
}

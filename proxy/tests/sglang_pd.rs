//! SGLang's disaggregated serving (`disaggregation.protocol: sglang`): both legs at once,
//! each the client's request with the prefill instance's bootstrap host and port and one
//! room; the prefill engine answers only once the decode leg has arrived (as a real one
//! answers once the decode engine joined its room); the client gets the decode answer.

#[allow(dead_code)]
mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response};
use serde_json::{Map, Value};
use support::{Backend, Recorded, TestProxy, closed_port, full, send};
use tokio::sync::Notify;

/// A prefill engine that answers `status` once `joined` is notified (the decode leg came).
async fn prefill_engine(joined: Arc<Notify>, status: u16) -> Backend {
    Backend::start(move |_| {
        let joined = Arc::clone(&joined);
        async move {
            // A leg that never meets its decode leg would wait for SGLang's bootstrap
            // timeout; here, a deadline fails the test instead.
            tokio::time::timeout(Duration::from_secs(10), joined.notified())
                .await
                .expect("the decode leg came while the prefill leg waited");
            Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(full(r#"{"choices":[{"index":0,"text":"p"}]}"#))
                .unwrap()
        }
    })
    .await
}

/// A decode engine that signals `joined` and answers.
async fn decode_engine(joined: Arc<Notify>) -> Backend {
    Backend::start(move |_| {
        let joined = Arc::clone(&joined);
        async move {
            joined.notify_one();
            Response::builder()
                .header("content-type", "application/json")
                .body(full(r#"{"choices":[{"index":0,"text":"decoded"}]}"#))
                .unwrap()
        }
    })
    .await
}

fn config(prefill: &[&str], decode: &str) -> String {
    let mut yaml = String::from(
        "health_check:\n  enabled: false\n\
         models:\n  - name: m\n    policy: kv\n    disaggregation:\n      protocol: sglang\n      mode: enforce\n      on_prefill_failure: fail\n    backends:\n",
    );
    for url in prefill {
        yaml.push_str(&format!(
            "      - url: {url}\n        role: prefill\n        bootstrap_port: 9123\n"
        ));
    }
    yaml.push_str(&format!("      - url: {decode}\n        role: decode\n"));
    yaml
}

async fn metric(proxy: &TestProxy, series: &str) -> f64 {
    let text = send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new())
        .await
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The legs' metric after they all answered (the prefill leg is counted after the decode).
async fn await_metric(proxy: &TestProxy, series: &str, value: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metric(proxy, series).await != value {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} never {value}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

const CLIENT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#;

async fn chat(proxy: &TestProxy) -> support::Reply {
    send(
        proxy.main,
        Method::POST,
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        CLIENT,
    )
    .await
}

/// The requests `engine` received, once it has `count` (deadline 5 s). A prefill leg goes out
/// beside its decode leg and is read after the answer is relayed: it may reach its engine
/// after the client has the decode leg's answer.
async fn received(engine: &Backend, count: usize) -> Vec<Recorded> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let requests = engine.requests();
        if requests.len() >= count || tokio::time::Instant::now() >= deadline {
            return requests;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn object(bytes: &[u8]) -> Map<String, Value> {
    serde_json::from_slice(bytes).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_legs_carry_the_request_and_one_bootstrap_room() {
    let joined = Arc::new(Notify::new());
    let prefill = prefill_engine(Arc::clone(&joined), 200).await;
    let decode = decode_engine(joined).await;
    let proxy = TestProxy::start(&config(&[&prefill.url], &decode.url)).await;
    let reply = chat(&proxy).await;
    assert_eq!(reply.status, 200);
    let route = reply.header("x-kvmesh-route").unwrap().to_string();
    assert!(
        route.starts_with(&format!("prefill={}", prefill.url)),
        "{route}"
    );
    assert_eq!(reply.json().await["choices"][0]["text"], "decoded");

    let (prefill_legs, decode_legs) = (received(&prefill, 1).await, decode.requests());
    assert_eq!((prefill_legs.len(), decode_legs.len()), (1, 1));
    let (p, d) = (&prefill_legs[0], &decode_legs[0]);
    assert_eq!(p.path, "/v1/chat/completions");
    assert_eq!(d.path, "/v1/chat/completions");
    assert_eq!(p.body, d.body, "the same leg twice");
    let leg = object(&p.body);
    assert_eq!(leg["bootstrap_host"], "127.0.0.1");
    assert_eq!(leg["bootstrap_port"], 9123);
    let room = leg["bootstrap_room"].as_u64().expect("a number");
    assert!(room < 1 << 63, "{room}");
    let mut rest = leg.clone();
    for field in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
        rest.remove(field);
    }
    assert_eq!(
        rest,
        object(CLIENT.as_bytes()),
        "the client's request, nothing else"
    );

    await_metric(
        &proxy,
        r#"kvmesh_prefill_legs_total{model="m",outcome="remote"}"#,
        1.0,
    )
    .await;
    // The next request gets a room of its own.
    assert_eq!(chat(&proxy).await.status, 200);
    let rooms: Vec<_> = prefill
        .requests()
        .iter()
        .map(|r| object(&r.body)["bootstrap_room"].clone())
        .collect();
    assert_ne!(rooms[0], rooms[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_engine_that_refuses_the_leg_is_failed_over() {
    let joined = Arc::new(Notify::new());
    let prefill = prefill_engine(Arc::clone(&joined), 200).await;
    let decode = decode_engine(joined).await;
    let dead = closed_port();
    let dead_url = format!("http://{}", dead.addr);
    let proxy = TestProxy::start(&config(&[&dead_url, &prefill.url], &decode.url)).await;
    for _ in 0..2 {
        let reply = chat(&proxy).await;
        assert_eq!(reply.status, 200);
        let route = reply.header("x-kvmesh-route").unwrap().to_string();
        assert!(
            route.starts_with(&format!("prefill={}", prefill.url)),
            "{route}"
        );
    }
    assert_eq!(received(&prefill, 2).await.len(), 2);
    assert_eq!(decode.requests().len(), 2);
    await_metric(
        &proxy,
        r#"kvmesh_prefill_legs_total{model="m",outcome="remote"}"#,
        2.0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_answering_an_error_is_counted_failed() {
    let joined = Arc::new(Notify::new());
    let prefill = prefill_engine(Arc::clone(&joined), 500).await;
    let decode = decode_engine(joined).await;
    let proxy = TestProxy::start(&config(&[&prefill.url], &decode.url)).await;
    // The decode engine answered: the client has its answer either way.
    assert_eq!(chat(&proxy).await.status, 200);
    await_metric(
        &proxy,
        r#"kvmesh_prefill_legs_total{model="m",outcome="failed"}"#,
        1.0,
    )
    .await;
    assert_eq!(
        metric(
            &proxy,
            r#"kvmesh_prefill_legs_total{model="m",outcome="remote"}"#
        )
        .await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_s_native_generate_runs_in_two_legs_too() {
    let joined = Arc::new(Notify::new());
    let prefill = prefill_engine(Arc::clone(&joined), 200).await;
    let decode = decode_engine(joined).await;
    let proxy = TestProxy::start(&config(&[&prefill.url], &decode.url)).await;
    // SGLang's /generate names no model: the proxy's only one serves it.
    let body = r#"{"text":"hi","sampling_params":{"max_new_tokens":3}}"#;
    let json = [("content-type", "application/json")];
    let reply = send(proxy.main, Method::POST, "/generate", &json, body).await;
    assert_eq!(reply.status, 200);
    let (prefill_legs, decode_legs) = (received(&prefill, 1).await, decode.requests());
    assert_eq!((prefill_legs.len(), decode_legs.len()), (1, 1));
    let (p, d) = (&prefill_legs[0], &decode_legs[0]);
    assert_eq!(
        (p.path.as_str(), d.path.as_str()),
        ("/generate", "/generate")
    );
    assert_eq!(p.body, d.body);
    let leg = object(&p.body);
    assert_eq!(leg["text"], "hi");
    assert!(leg["bootstrap_room"].is_u64(), "{leg:?}");
}

//! API keys: 401 / 403 / 429 with OpenAI-shaped bodies and the right headers,
//! token limits charged while the response streams, and the key kept from engines.

#[allow(dead_code)]
mod support;

mod edge_support;

use std::time::Duration;

use bytes::Bytes;
use edge_support::{EdgeProxy, Reply, plain};
use http::Method;
use kvmesh_proxy::sha256_hex;
use support::{Backend, held_first};

const KEY_A: &str = "sk-test-a";
const KEY_B: &str = "sk-test-b";

fn yaml(backend: &str, keys: &str) -> String {
    format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         health_check:\n  enabled: false\n\
         models:\n  - name: m\n    aliases: [m-alias]\n    backends:\n      - url: {backend}\n  \
         - name: other\n    backends:\n      - url: {backend}\n\
         auth:\n  keys:\n{keys}"
    )
}

fn key(name: &str, secret: &str, extra: &str) -> String {
    format!(
        "    - name: {name}\n      sha256: {}\n{extra}",
        sha256_hex(secret.as_bytes())
    )
}

async fn chat(proxy: &EdgeProxy, key: Option<&str>, model: &str, stream: bool) -> Reply {
    let bearer = key.map(|key| format!("Bearer {key}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(bearer) = bearer.as_deref() {
        headers.push(("authorization", bearer));
    }
    let body = format!(
        r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"hello there"}}]}}"#
    );
    plain(
        proxy.main,
        Method::POST,
        "/v1/chat/completions",
        &headers,
        Bytes::from(body),
    )
    .await
}

fn error_of(reply: &Reply) -> serde_json::Value {
    let json = reply.json();
    let error = json["error"].clone();
    for field in ["message", "type", "param", "code"] {
        assert!(error.get(field).is_some(), "no {field} in {json}");
    }
    error
}

#[tokio::test]
async fn missing_and_unknown_keys_get_401() {
    let backend = Backend::ok().await;
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, &key("a", KEY_A, ""))).await;

    let missing = chat(&proxy, None, "m", false).await;
    assert_eq!(missing.status, 401);
    assert_eq!(missing.header("www-authenticate"), Some("Bearer"));
    assert!(missing.header("x-request-id").is_some());
    let error = error_of(&missing);
    assert_eq!(error["code"], "missing_api_key");
    assert_eq!(error["type"], "invalid_request_error");

    let wrong = chat(&proxy, Some("sk-wrong"), "m", false).await;
    assert_eq!(wrong.status, 401);
    let error = error_of(&wrong);
    assert_eq!(error["code"], "invalid_api_key");
    assert!(!error["message"].as_str().unwrap().contains("sk-wrong"));

    let models = plain(proxy.main, Method::GET, "/v1/models", &[], Bytes::new()).await;
    assert_eq!(models.status, 401);
    let bearer = format!("Bearer {KEY_A}");
    let models = plain(
        proxy.main,
        Method::GET,
        "/v1/models",
        &[("authorization", &bearer)],
        Bytes::new(),
    )
    .await;
    assert_eq!(models.status, 200);

    assert_eq!(chat(&proxy, Some(KEY_A), "m", false).await.status, 200);
    assert_eq!(backend.requests().len(), 1);
    let forwarded = &backend.requests()[0];
    assert!(
        !forwarded.headers.contains_key("authorization"),
        "the gateway key reached the engine"
    );
    assert_eq!(
        proxy
            .metric(r#"kvmesh_auth_rejections_total{reason="missing_key"}"#)
            .await,
        2.0
    );
    assert_eq!(
        proxy
            .metric(r#"kvmesh_auth_rejections_total{reason="invalid_key"}"#)
            .await,
        1.0
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_key_may_use_only_its_models() {
    let backend = Backend::ok().await;
    let keys = key("a", KEY_A, "      models: [m-alias]\n");
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, &keys)).await;
    assert_eq!(chat(&proxy, Some(KEY_A), "m", false).await.status, 200);
    assert_eq!(
        chat(&proxy, Some(KEY_A), "m-alias", false).await.status,
        200
    );
    let denied = chat(&proxy, Some(KEY_A), "other", false).await;
    assert_eq!(denied.status, 403);
    let error = error_of(&denied);
    assert_eq!(error["type"], "permission_error");
    assert_eq!(error["code"], "model_not_allowed");
    assert_eq!(error["param"], "model");
    assert_eq!(
        proxy
            .metric(r#"kvmesh_auth_rejections_total{reason="model_not_allowed"}"#)
            .await,
        1.0
    );
    proxy.stop().await;
}

#[tokio::test]
async fn over_the_request_rate_is_429_with_retry_after() {
    let backend = Backend::ok().await;
    let keys = format!(
        "{}{}",
        key("a", KEY_A, "      requests_per_second: 1\n"),
        key("b", KEY_B, "")
    );
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, &keys)).await;
    assert_eq!(chat(&proxy, Some(KEY_A), "m", false).await.status, 200);
    let limited = chat(&proxy, Some(KEY_A), "m", false).await;
    assert_eq!(limited.status, 429);
    assert_eq!(limited.header("retry-after"), Some("1"));
    let error = error_of(&limited);
    assert_eq!(error["type"], "requests");
    assert_eq!(error["code"], "rate_limit_exceeded");
    // Another key is not affected.
    assert_eq!(chat(&proxy, Some(KEY_B), "m", false).await.status, 200);
    assert_eq!(
        proxy
            .metric(r#"kvmesh_rate_limited_total{key="a",limit="requests_per_second"}"#)
            .await,
        1.0
    );
    proxy.stop().await;
}

/// A streamed chat request with key A, answered in a task.
fn stream_with_key_a(proxy: &EdgeProxy) -> tokio::task::JoinHandle<Reply> {
    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    chat_with_key_a(proxy, body)
}

/// A chat request with key A and `body`, answered in a task.
fn chat_with_key_a(proxy: &EdgeProxy, body: &'static str) -> tokio::task::JoinHandle<Reply> {
    let main = proxy.main;
    tokio::spawn(async move {
        let bearer = format!("Bearer {KEY_A}");
        plain(
            main,
            Method::POST,
            "/v1/chat/completions",
            &[
                ("content-type", "application/json"),
                ("authorization", &bearer),
            ],
            Bytes::from(body),
        )
        .await
    })
}

#[tokio::test]
async fn a_last_usage_event_without_its_blank_line_is_charged() {
    let (tx, backend) = held_first(Some("text/event-stream")).await;
    let keys = key("a", KEY_A, "      tokens_per_minute: 100000\n");
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, &keys)).await;
    let streaming = stream_with_key_a(&proxy);
    let usage = r#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":500}}"#;
    tx.send(Ok(Bytes::from_static(b"data: {\"choices\":[]}\n\n")))
        .await
        .unwrap();
    tx.send(Ok(Bytes::from(usage))).await.unwrap();
    drop(tx);
    let finished = streaming.await.unwrap();
    assert_eq!(finished.status, 200);
    // One CI run saw this stream answered `{}`, the backend's answer to a second request:
    // the message names every request it got.
    let seen = backend.seen();
    assert_eq!(seen.len(), 1, "{seen:#?}");
    assert!(
        finished.body.ends_with(usage.as_bytes()),
        "{:?}",
        finished.body
    );
    let series = r#"kvmesh_key_tokens_total{key="a",kind="completion"}"#;
    assert_eq!(proxy.metric(series).await, 500.0);
    proxy.stop().await;
}

#[tokio::test]
async fn completion_tokens_are_charged_while_the_response_streams() {
    let (tx, backend) = held_first(Some("text/event-stream")).await;
    // 60 tokens a minute: the prompt (estimated from its ~100-byte body) and a
    // few streamed events leave the bucket in debt.
    let keys = key("a", KEY_A, "      tokens_per_minute: 60\n");
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, &keys)).await;
    let streaming = stream_with_key_a(&proxy);
    for i in 0..60 {
        let event = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n");
        tx.send(Ok(Bytes::from(event))).await.unwrap();
    }
    // While the stream is still open, its tokens already count.
    let series = r#"kvmesh_key_tokens_total{key="a",kind="completion"}"#;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while proxy.metric(series).await < 60.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "completion tokens not charged"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let limited = chat(&proxy, Some(KEY_A), "m", false).await;
    assert_eq!(limited.status, 429);
    let error = error_of(&limited);
    assert_eq!(error["type"], "tokens");
    let retry: u64 = limited.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=120).contains(&retry), "{retry}");
    drop(tx);
    let finished = streaming.await.unwrap();
    assert_eq!(finished.status, 200);
    assert!(
        proxy
            .metric(r#"kvmesh_key_tokens_total{key="a",kind="prompt"}"#)
            .await
            > 0.0
    );
    proxy.stop().await;
}

#[tokio::test]
async fn over_max_concurrency_is_429() {
    let (tx, backend) = held_first(None).await;
    let keys = key("a", KEY_A, "      max_concurrency: 1\n");
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, &keys)).await;
    let held = chat_with_key_a(&proxy, r#"{"model":"m"}"#);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while proxy.metric(r#"kvmesh_key_in_flight{key="a"}"#).await < 1.0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let limited = chat(&proxy, Some(KEY_A), "m", false).await;
    assert_eq!(limited.status, 429);
    assert_eq!(error_of(&limited)["code"], "rate_limit_exceeded");
    assert!(limited.header("retry-after").is_some());
    drop(tx);
    assert_eq!(held.await.unwrap().status, 200);
    assert_eq!(chat(&proxy, Some(KEY_A), "m", false).await.status, 200);
    proxy.stop().await;
}

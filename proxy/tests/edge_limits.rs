//! Limits on what clients send and on a model's concurrency: 431 for heads
//! over the limits, 408 for clients too slow with their head or body, and 503
//! from a model's bounded queue.

#[allow(dead_code)]
mod support;

mod edge_support;

use std::time::Duration;

use bytes::Bytes;
use edge_support::{EdgeProxy, plain};
use http::Method;
use support::{Backend, held_first};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout};

fn yaml(backend: &str, limits: &str, model: &str) -> String {
    format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         health_check:\n  enabled: false\nlimits:\n{limits}\
         models:\n  - name: m\n    backends:\n      - url: {backend}\n{model}"
    )
}

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

#[tokio::test]
async fn heads_over_the_limits_get_431() {
    let backend = Backend::ok().await;
    let limits = "  max_headers: 10\n  max_header_bytes: 2048\n";
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, limits, "")).await;
    let many: Vec<(String, String)> = (0..12).map(|i| (format!("x-h{i}"), "v".into())).collect();
    let headers: Vec<(&str, &str)> = many.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    let reply = plain(
        proxy.main,
        Method::POST,
        "/v1/chat/completions",
        &headers,
        Bytes::from(CHAT),
    )
    .await;
    assert_eq!(reply.status, 431);
    assert_eq!(
        reply.json()["error"]["code"],
        "request_header_fields_too_large"
    );
    let big = "x".repeat(3000);
    let reply = plain(
        proxy.main,
        Method::POST,
        "/v1/chat/completions",
        &[("x-big", &big)],
        Bytes::from(CHAT),
    )
    .await;
    assert_eq!(reply.status, 431);
    assert!(
        reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("2048")
    );
    let fine = plain(
        proxy.main,
        Method::POST,
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Bytes::from(CHAT),
    )
    .await;
    assert_eq!(fine.status, 200);
    assert_eq!(
        proxy
            .metric(r#"kvmesh_client_errors_total{reason="headers_too_large"}"#)
            .await,
        2.0
    );
    assert!(backend.requests().len() == 1);
    proxy.stop().await;
}

/// Reads what the server sends until it closes the connection (bounded by `limit`).
async fn read_until_closed(tcp: &mut TcpStream, limit: Duration) -> String {
    let mut out = Vec::new();
    let read = timeout(limit, tcp.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the connection was not closed");
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn slow_clients_are_cut_off_with_408_and_counted() {
    let backend = Backend::ok().await;
    let limits = "  client_header_timeout: 300ms\n";
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, limits, "")).await;

    // A head that never ends.
    let started = Instant::now();
    let mut tcp = TcpStream::connect(proxy.main).await.unwrap();
    tcp.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let answer = read_until_closed(&mut tcp, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert!(answer.contains("\"code\":\"request_timeout\""), "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(300));

    // A body that never ends.
    let mut tcp = TcpStream::connect(proxy.main).await.unwrap();
    tcp.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let answer = read_until_closed(&mut tcp, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");

    // A head the parser refuses.
    let mut tcp = TcpStream::connect(proxy.main).await.unwrap();
    tcp.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nbad header line\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until_closed(&mut tcp, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");

    assert_eq!(
        proxy
            .metric(r#"kvmesh_client_errors_total{reason="request_timeout"}"#)
            .await,
        2.0
    );
    assert!(backend.requests().is_empty());
    // An idle keep-alive connection is closed quietly, not counted.
    let reply = plain(proxy.main, Method::GET, "/v1/models", &[], Bytes::new()).await;
    assert_eq!(reply.status, 200);
    proxy.stop().await;
}

#[tokio::test]
async fn a_models_queue_is_bounded_and_times_out_with_503() {
    let (tx, backend) = held_first(None).await;
    let model = "    concurrency:\n      max_in_flight: 1\n      queue_size: 1\n      queue_timeout: 300ms\n";
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, "  retries: 0\n", model)).await;
    let post = |main| async move {
        plain(
            main,
            Method::POST,
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            Bytes::from(CHAT),
        )
        .await
    };
    let held = tokio::spawn(post(proxy.main));
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.requests().is_empty() {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let queued = tokio::spawn(post(proxy.main));
    while proxy.metric(r#"kvmesh_model_queue_depth{model="m"}"#).await < 1.0 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let full_queue = post(proxy.main).await;
    assert_eq!(full_queue.status, 503);
    assert_eq!(
        full_queue.json()["error"]["code"],
        "model_concurrency_limit"
    );
    assert!(full_queue.header("retry-after").is_some());
    let timed_out = queued.await.unwrap();
    assert_eq!(timed_out.status, 503);
    assert!(
        timed_out.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("in time")
    );
    drop(tx);
    assert_eq!(held.await.unwrap().status, 200);
    assert_eq!(post(proxy.main).await.status, 200);
    for (reason, count) in [("queue_full", 1.0), ("queue_timeout", 1.0)] {
        let series =
            format!(r#"kvmesh_model_queue_rejections_total{{model="m",reason="{reason}"}}"#);
        assert_eq!(proxy.metric(&series).await, count, "{reason}");
    }
    assert_eq!(
        proxy
            .metric(r#"kvmesh_model_concurrency_limit{model="m"}"#)
            .await,
        1.0
    );
    proxy.stop().await;
}

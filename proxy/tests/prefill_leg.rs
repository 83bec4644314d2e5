//! A disaggregated model's prefill leg goes the spine's way: a prefill engine answering 5xx
//! is judged (towards its ejection) and retried around on another prefill engine, and a
//! pooled connection the engine closed while idle is retried on a fresh one.

#[allow(dead_code)]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Method, Response};
use support::{Backend, TestProxy, full, send};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A prefill engine answering every leg 200 with `kv_transfer_params` naming `engine`.
async fn prefill_engine(engine: &'static str) -> Backend {
    Backend::start(move |_| async move {
        let body = serde_json::json!({
            "choices": [{"index": 0, "text": "x"}],
            "kv_transfer_params": {"remote_engine_id": engine, "remote_block_ids": [1]},
        });
        Response::builder()
            .header("content-type", "application/json")
            .body(full(body.to_string()))
            .unwrap()
    })
    .await
}

/// A decode engine answering 200 with the `remote_engine_id` its leg carried.
async fn decode_engine() -> Backend {
    Backend::start(|request| async move {
        let leg: serde_json::Value = serde_json::from_slice(&request.body).unwrap_or_default();
        let from = leg["kv_transfer_params"]["remote_engine_id"].clone();
        let body = serde_json::json!({"choices": [{"index": 0, "text": "y"}], "from": from});
        Response::builder()
            .header("content-type", "application/json")
            .body(full(body.to_string()))
            .unwrap()
    })
    .await
}

/// The config of model `m`, disaggregated (`enforce`, failures refused) over `prefill` and
/// `decode` engines, with ejection after two failures.
fn config(prefill: &[&str], decode: &str) -> String {
    let mut yaml = String::from(
        "health_check:\n  enabled: false\noutlier_detection:\n  consecutive_failures: 2\n  base_ejection_time: 60s\n\
         models:\n  - name: m\n    policy: kv\n    disaggregation:\n      mode: enforce\n      on_prefill_failure: fail\n    backends:\n",
    );
    for url in prefill {
        yaml.push_str(&format!("      - url: {url}\n        role: prefill\n"));
    }
    yaml.push_str(&format!("      - url: {decode}\n        role: decode\n"));
    yaml
}

async fn complete(proxy: &TestProxy) -> (u16, serde_json::Value) {
    let body = r#"{"model":"m","prompt":"hello","max_tokens":2}"#;
    let reply = send(
        proxy.main,
        Method::POST,
        "/v1/completions",
        &[("content-type", "application/json")],
        Bytes::from_static(body.as_bytes()),
    )
    .await;
    let status = reply.status.as_u16();
    (status, reply.json().await)
}

/// `kvmesh_instance_healthy` of the instance at `url` in a scrape.
fn healthy_gauge(text: &str, url: &str) -> Option<u8> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix("kvmesh_instance_healthy{instance=\"")?;
        let (instance, value) = rest.split_once("\",model=\"m\"} ")?;
        (instance.trim_end_matches('/') == url).then(|| value.parse().ok())?
    })
}

async fn metrics(proxy: &TestProxy) -> String {
    send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new())
        .await
        .text()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_engine_answering_503_is_retried_around_and_ejected() {
    let failing = Backend::start(|_| async {
        Response::builder()
            .status(503)
            .header("content-type", "application/json")
            .body(full(r#"{"error":{"message":"overloaded"}}"#))
            .unwrap()
    })
    .await;
    let healthy = prefill_engine("p-ok").await;
    let decode = decode_engine().await;
    let proxy = TestProxy::start(&config(&[&failing.url, &healthy.url], &decode.url)).await;
    for n in 0..20 {
        let (status, answer) = complete(&proxy).await;
        assert_eq!(status, 200, "request {n}: {answer}");
        assert_eq!(
            answer["from"], "p-ok",
            "the decode leg carries the healthy prefill's params"
        );
    }
    assert_eq!(healthy.requests().len(), 20);
    // Picked by load among equals, the failing engine got legs until two 5xx in a row
    // ejected it (for 60 s); each was retried on the healthy one.
    assert_eq!(failing.requests().len(), 2);
    let text = metrics(&proxy).await;
    assert_eq!(
        healthy_gauge(&text, &failing.url),
        Some(0),
        "ejected:\n{text}"
    );
    assert_eq!(healthy_gauge(&text, &healthy.url), Some(1));
    assert!(
        text.contains("kvmesh_retries_total{model=\"m\",reason=\"status\"} 2"),
        "{text}"
    );
}

/// A plaintext HTTP/1.1 prefill engine that answers the first leg on each connection and
/// closes the connection when the next one arrives on it, as an engine whose keep-alive
/// timer ran out while the connection sat in the proxy's pool. Counts the legs it dropped.
async fn closing_prefill_engine() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let dropped = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&dropped);
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 65536];
                let mut seen = Vec::new();
                // Reads one request (the head and its Content-Length body).
                let whole = |seen: &[u8]| {
                    let text = String::from_utf8_lossy(seen);
                    let Some(end) = text.find("\r\n\r\n") else {
                        return false;
                    };
                    let length = text[..end]
                        .lines()
                        .find_map(|line| {
                            let (name, value) = line.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse::<usize>().ok())?
                        })
                        .unwrap_or(0);
                    seen.len() >= end + 4 + length
                };
                while !whole(&seen) {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buffer[..n]),
                    }
                }
                let body =
                    r#"{"choices":[],"kv_transfer_params":{"remote_engine_id":"p-closing"}}"#;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if stream.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
                // The next request on this connection is dropped unanswered.
                if let Ok(n) = stream.read(&mut buffer).await
                    && n > 0
                {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    (url, dropped)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_leg_on_a_pooled_connection_the_engine_closed_reconnects() {
    let (prefill, dropped) = closing_prefill_engine().await;
    let decode = decode_engine().await;
    let proxy = TestProxy::start(&config(&[&prefill], &decode.url)).await;
    for n in 0..3 {
        let (status, answer) = complete(&proxy).await;
        assert_eq!(status, 200, "request {n}: {answer}");
        assert_eq!(answer["from"], "p-closing");
    }
    // Every leg after the first went out on the pooled connection first, which the engine
    // closed; each was sent again on a fresh connection.
    assert_eq!(dropped.load(Ordering::Relaxed), 2);
    let text = metrics(&proxy).await;
    assert_eq!(
        healthy_gauge(&text, &prefill),
        Some(1),
        "a stale connection is not the engine's failure:\n{text}"
    );
}

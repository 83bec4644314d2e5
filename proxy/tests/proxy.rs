//! The proxy through its library entry point, in front of in-test hyper backends.

#[allow(dead_code)]
mod support;

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response};
use support::{
    Backend, TestProxy, await_health, channel_body, chat, closed_port, error_of, full, model_yaml,
    send, send_h2c,
};
use tokio::sync::oneshot;
use tokio::time::timeout;

/// A body with odd spacing, escapes, unknown fields and non-ASCII text: any
/// re-serialisation would change it.
const ODD_BODY: &str = "{ \"messages\" : [ {\"role\":\"user\",\"content\":\"h\\u00e9llo \\\"q\\\" \u{1F600}\"} ],\n  \"model\":\"m\", \"x_extra\": [1, 2.50, {\"n\": null}],\"stream\":false }";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_the_body_through_byte_identical() {
    let reply_body = "{\"id\":\"c1\",  \"choices\":[] }\n";
    let backend = Backend::start(move |_| async move {
        Response::builder()
            .header("content-type", "application/json")
            .header("x-engine", "sim")
            .body(full(reply_body))
            .unwrap()
    })
    .await;
    let proxy = TestProxy::start(&model_yaml("m", &[&backend.url], "")).await;

    let reply = chat(proxy.main, ODD_BODY).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("x-kvmesh-instance"),
        Some(backend.url.as_str())
    );
    assert_eq!(reply.header("x-engine"), Some("sim"));
    let request_id = reply.header("x-request-id").unwrap().to_string();
    assert!(!request_id.is_empty());
    assert_eq!(reply.text().await.unwrap(), reply_body);

    let seen = backend.requests();
    assert_eq!(seen.len(), 1);
    let request = &seen[0];
    assert_eq!(request.method, Method::POST);
    assert_eq!(request.path, "/v1/chat/completions");
    assert_eq!(request.body, Bytes::from(ODD_BODY));
    assert_eq!(request.headers["host"], backend.addr.to_string());
    assert_eq!(request.headers["content-type"], "application/json");
    assert_eq!(
        request.headers["content-length"],
        ODD_BODY.len().to_string()
    );
    assert_eq!(request.headers["x-request-id"], request_id.as_str());
    assert!(!request.headers.contains_key("connection"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuses_upstream_connections() {
    let backend = Backend::ok().await;
    let yaml = format!(
        "{}health_check:\n  enabled: false\n",
        model_yaml("m", &[&backend.url], "")
    );
    let proxy = TestProxy::start(&yaml).await;
    for i in 1..=10 {
        let reply = chat(proxy.main, r#"{"model":"m"}"#).await;
        assert_eq!(reply.status, 200);
        reply.text().await.unwrap();
        // The connection goes back to the pool just after the last byte reaches the client,
        // before the exchange is counted: wait for the count, then send the next request.
        let counted = format!(
            "kvmesh_requests_total{{model=\"m\",protocol=\"http\",route=\"chat_completions\",status=\"200\"}} {i}"
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let metrics = send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new())
                .await
                .text()
                .await
                .unwrap();
            if metrics.contains(&counted) {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "never counted {i}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // Only the ten chats reached it (one CI run saw 13 requests: what else, and from where,
    // the message says: its method, path and request id).
    let seen = backend.seen();
    assert_eq!(seen.len(), 10, "{seen:#?}");
    // pingora hands a pooled connection back through an idle-watch task; when that task
    // still holds the connection as the next request asks for it, the request opens a new
    // one. Without pooling every request would open its own.
    let connections = backend.connections();
    assert!(
        connections <= 3,
        "sequential requests reuse pooled connections: {connections} for 10 requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn propagates_the_client_request_id_and_routes_aliases() {
    let backend = Backend::ok().await;
    let yaml = format!(
        "models:\n  - name: m\n    aliases: [alias]\n    backends:\n      - url: {}\n",
        backend.url
    );
    let proxy = TestProxy::start(&yaml).await;
    let reply = send(
        proxy.main,
        Method::POST,
        "/v1/embeddings?user=1",
        &[
            ("content-type", "application/json"),
            ("x-request-id", "req-abc-123"),
        ],
        r#"{"model":"alias","input":"x"}"#,
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-request-id"), Some("req-abc-123"));
    let seen = backend.requests();
    assert_eq!(seen[0].headers["x-request-id"], "req-abc-123");
    assert_eq!(seen[0].path, "/v1/embeddings?user=1");

    let a = chat(proxy.main, r#"{"model":"m"}"#).await;
    let b = chat(proxy.main, r#"{"model":"m"}"#).await;
    assert_ne!(a.header("x-request-id"), b.header("x-request-id"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_sse_chunk_by_chunk() {
    let (seen_first_tx, seen_first_rx) = oneshot::channel::<()>();
    let seen_first = std::sync::Mutex::new(Some(seen_first_rx));
    let backend = Backend::start(move |request| {
        // Health probes reach the handler too: only the chat request takes the gate.
        let gate = (request.path == "/v1/chat/completions")
            .then(|| seen_first.lock().unwrap().take())
            .flatten();
        async move {
            let (tx, body) = channel_body();
            tokio::spawn(async move {
                let _ = tx
                    .send(Ok(Bytes::from_static(b"data: {\"n\":1}\n\n")))
                    .await;
                // The second event waits until the client has seen the first.
                if let Some(gate) = gate {
                    let _ = gate.await;
                }
                let _ = tx
                    .send(Ok(Bytes::from_static(b"data: {\"n\":2}\n\n")))
                    .await;
                let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(body)
                .unwrap()
        }
    })
    .await;
    let proxy = TestProxy::start(&model_yaml("m", &[&backend.url], "")).await;

    let mut reply = chat(proxy.main, r#"{"model":"m","stream":true}"#).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("text/event-stream"));
    assert_eq!(reply.header("transfer-encoding"), Some("chunked"));
    let first = timeout(Duration::from_secs(5), reply.next_chunk())
        .await
        .expect("the first event arrives before the second is produced")
        .unwrap()
        .unwrap();
    assert_eq!(first, Bytes::from_static(b"data: {\"n\":1}\n\n"));
    seen_first_tx.send(()).unwrap();
    let rest = reply.text().await.unwrap();
    assert_eq!(rest, "data: {\"n\":2}\n\ndata: [DONE]\n\n");

    let metrics = send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new())
        .await
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvmesh_time_to_first_token_seconds_count{model=\"m\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvmesh_inter_token_latency_seconds_count{model=\"m\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_dying_mid_stream_ends_with_an_error_event() {
    let backend = Backend::start(|_| async {
        let (tx, body) = channel_body();
        tokio::spawn(async move {
            let _ = tx
                .send(Ok(Bytes::from_static(b"data: {\"n\":1}\n\n")))
                .await;
            let _ = tx.send(Ok(Bytes::from_static(b"data: {\"half"))).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = tx.send(Err(std::io::Error::other("engine crashed"))).await;
        });
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(body)
            .unwrap()
    })
    .await;
    let proxy = TestProxy::start(&model_yaml("m", &[&backend.url], "")).await;
    let reply = chat(proxy.main, r#"{"model":"m","stream":true}"#).await;
    assert_eq!(reply.status, 200);
    let text = timeout(Duration::from_secs(5), reply.text())
        .await
        .unwrap()
        .expect("a clean end of body");
    let events: Vec<&str> = text.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 2, "{text:?}");
    assert_eq!(events[0], "data: {\"n\":1}");
    let error: serde_json::Value =
        serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["code"], "upstream_disconnected");

    // A non-streamed body cut short closes the client connection instead.
    let cut = Backend::start(|_| async {
        let (tx, body) = channel_body();
        tokio::spawn(async move {
            let _ = tx.send(Ok(Bytes::from_static(b"{\"partial\":"))).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = tx.send(Err(std::io::Error::other("engine crashed"))).await;
        });
        Response::builder()
            .header("content-type", "application/json")
            .body(body)
            .unwrap()
    })
    .await;
    let proxy = TestProxy::start(&model_yaml("m", &[&cut.url], "")).await;
    let reply = chat(proxy.main, r#"{"model":"m"}"#).await;
    assert_eq!(reply.status, 200);
    assert!(
        reply.text().await.is_err(),
        "an incomplete body is an error"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejects_bad_requests_with_openai_errors() {
    let backend = Backend::ok().await;
    let yaml = format!(
        "{}limits:\n  max_body_bytes: 64\n",
        model_yaml("m", &[&backend.url], "")
    );
    let proxy = TestProxy::start(&yaml).await;

    let reply = chat(proxy.main, "{not json").await;
    assert_eq!(reply.status, 400);
    assert_eq!(error_of(reply).await["code"], "invalid_json");

    let reply = chat(proxy.main, r#"{"messages":[]}"#).await;
    assert_eq!(reply.status, 400);
    let error = error_of(reply).await;
    assert_eq!(error["code"], "missing_model");
    assert_eq!(error["param"], "model");

    let reply = chat(proxy.main, r#"{"model":7}"#).await;
    assert_eq!(reply.status, 400);
    assert_eq!(error_of(reply).await["type"], "invalid_request_error");

    let reply = chat(proxy.main, r#"{"model":"gpt-9"}"#).await;
    assert_eq!(reply.status, 404);
    let error = error_of(reply).await;
    assert_eq!(error["code"], "model_not_found");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("known models: m")
    );

    let reply = send(
        proxy.main,
        Method::GET,
        "/v1/chat/completions",
        &[],
        Bytes::new(),
    )
    .await;
    assert_eq!(reply.status, 405);
    assert_eq!(reply.header("allow"), Some("POST"));
    assert_eq!(error_of(reply).await["code"], "method_not_allowed");

    let reply = send(proxy.main, Method::GET, "/v2/nothing", &[], Bytes::new()).await;
    assert_eq!(reply.status, 404);
    assert_eq!(error_of(reply).await["code"], "unknown_url");

    let big = format!(r#"{{"model":"m","pad":"{}"}}"#, "x".repeat(100));
    let reply = chat(proxy.main, &big).await;
    assert_eq!(reply.status, 413);
    assert_eq!(error_of(reply).await["code"], "request_too_large");

    assert!(
        backend.requests().is_empty(),
        "nothing bad reached the engine"
    );

    let metrics = send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new())
        .await
        .text()
        .await
        .unwrap();
    for reason in [
        "invalid_json",
        "missing_model",
        "invalid_body",
        "model_not_found",
        "method_not_allowed",
        "unknown_path",
        "body_too_large",
    ] {
        let line = format!("kvmesh_client_errors_total{{reason=\"{reason}\"}} 1");
        assert!(metrics.contains(&line), "no {line} in\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_chunked_bodies_against_the_limit() {
    let backend = Backend::ok().await;
    let yaml = format!(
        "{}limits:\n  max_body_bytes: 64\n",
        model_yaml("m", &[&backend.url], "")
    );
    let proxy = TestProxy::start(&yaml).await;
    // A raw chunked request: no Content-Length to check up front.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(proxy.main).await.unwrap();
    let chunk = "x".repeat(40);
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: p\r\ntransfer-encoding: chunked\r\n\r\n28\r\n{chunk}\r\n28\r\n{chunk}\r\n0\r\n\r\n"
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    let _ = timeout(Duration::from_secs(5), tcp.read_to_end(&mut response)).await;
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("request_too_large"), "{text}");

    // Chunked bodies under the limit are forwarded with a Content-Length.
    let mut tcp = tokio::net::TcpStream::connect(proxy.main).await.unwrap();
    let request = "POST /v1/completions HTTP/1.1\r\nhost: p\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n6\r\n{\"mode\r\n9\r\nl\":\"m\"}  \r\n0\r\n\r\n";
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    let _ = timeout(Duration::from_secs(5), tcp.read_to_end(&mut response)).await;
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let seen = backend.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, Bytes::from_static(b"{\"model\":\"m\"}  "));
    assert_eq!(seen[0].headers["content-length"], "15");
    assert!(!seen[0].headers.contains_key("transfer-encoding"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_over_from_a_refused_port() {
    let backend = Backend::ok().await;
    let closed = closed_port();
    let dead = format!("http://{}", closed.addr);
    let yaml = format!(
        "{}health_check:\n  enabled: false\n",
        model_yaml("m", &[&dead, &backend.url], "")
    );
    let proxy = TestProxy::start(&yaml).await;
    for i in 0..6 {
        let reply = chat(proxy.main, r#"{"model":"m"}"#).await;
        assert_eq!(reply.status, 200, "request {i}");
        assert_eq!(
            reply.header("x-kvmesh-instance"),
            Some(backend.url.as_str())
        );
    }
    assert_eq!(backend.requests().len(), 6);
    let metrics = send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new())
        .await
        .text()
        .await
        .unwrap();
    let connect_errors =
        format!("kvmesh_upstream_errors_total{{instance=\"{dead}\",kind=\"connect\",model=\"m\"}}");
    assert!(metrics.contains(&connect_errors), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_engine_is_502() {
    let closed = closed_port();
    let dead = format!("http://{}", closed.addr);
    let yaml = format!(
        "{}health_check:\n  enabled: false\n",
        model_yaml("m", &[&dead], "")
    );
    let proxy = TestProxy::start(&yaml).await;
    let reply = chat(proxy.main, r#"{"model":"m"}"#).await;
    assert_eq!(reply.status, 502);
    assert_eq!(error_of(reply).await["code"], "upstream_unavailable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_engine_is_504() {
    let backend = Backend::start(|_| async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        Response::new(full("late"))
    })
    .await;
    let yaml = format!(
        "{}limits:\n  first_byte_timeout: 200ms\nhealth_check:\n  enabled: false\n",
        model_yaml("m", &[&backend.url], "")
    );
    let proxy = TestProxy::start(&yaml).await;
    let started = tokio::time::Instant::now();
    let reply = chat(proxy.main, r#"{"model":"m"}"#).await;
    assert_eq!(reply.status, 504);
    assert!(started.elapsed() < Duration::from_secs(2));
    let error = error_of(reply).await;
    assert_eq!(error["type"], "timeout");
    assert_eq!(error["code"], "upstream_timeout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_healthy_instance_is_503_with_retry_after() {
    let sick = Backend::start(|request| async move {
        let status = if request.path == "/health" { 500 } else { 200 };
        Response::builder().status(status).body(full("")).unwrap()
    })
    .await;
    let yaml = format!(
        "{}health_check:\n  interval: 50ms\n  unhealthy_threshold: 1\n",
        model_yaml("m", &[&sick.url], "")
    );
    let proxy = TestProxy::start(&yaml).await;
    await_health(proxy.admin, 503).await;
    let reply = chat(proxy.main, r#"{"model":"m"}"#).await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.header("retry-after"), Some("1"));
    let error = error_of(reply).await;
    assert_eq!(error["type"], "service_unavailable");
    assert!(sick.requests().is_empty());
    let metrics = send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new())
        .await
        .text()
        .await
        .unwrap();
    let gauge = format!(
        "kvmesh_instance_healthy{{instance=\"{}\",model=\"m\"}} 0",
        sick.url
    );
    assert!(metrics.contains(&gauge), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ejects_an_engine_that_keeps_failing() {
    let failing = Backend::start(|request| async move {
        let status = if request.path == "/health" { 200 } else { 500 };
        Response::builder()
            .status(status)
            .body(full("boom"))
            .unwrap()
    })
    .await;
    let good = Backend::ok().await;
    let yaml = format!(
        "{}outlier_detection:\n  consecutive_failures: 2\n  base_ejection_time: 10s\n",
        model_yaml("m", &[&failing.url, &good.url], "")
    );
    let proxy = TestProxy::start(&yaml).await;
    let mut statuses = Vec::new();
    for _ in 0..10 {
        statuses.push(chat(proxy.main, r#"{"model":"m"}"#).await.status.as_u16());
    }
    // Round robin alternates until the failing engine's second 5xx ejects it; each of its
    // 500s is retried on the good engine, so no client sees one.
    assert_eq!(statuses, [200; 10], "{statuses:?}");
    assert_eq!(failing.requests().len(), 2);
    assert_eq!(good.requests().len(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_errors_from_the_engine_never_eject() {
    let picky = Backend::start(|_| async {
        Response::builder()
            .status(400)
            .body(full(r#"{"error":{}}"#))
            .unwrap()
    })
    .await;
    let yaml = format!(
        "{}outlier_detection:\n  consecutive_failures: 1\n",
        model_yaml("m", &[&picky.url], "")
    );
    let proxy = TestProxy::start(&yaml).await;
    for _ in 0..5 {
        let reply = chat(proxy.main, r#"{"model":"m"}"#).await;
        assert_eq!(reply.status, 400);
        assert_eq!(reply.header("x-kvmesh-instance"), Some(picky.url.as_str()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_models_and_serves_admin_endpoints() {
    let backend = Backend::ok().await;
    let yaml = format!(
        "models:\n  - name: m\n    aliases: [m-alias]\n    backends:\n      - url: {}\n",
        backend.url
    );
    let proxy = TestProxy::start(&yaml).await;
    let reply = send(proxy.main, Method::GET, "/v1/models", &[], Bytes::new()).await;
    assert_eq!(reply.status, 200);
    let list = reply.json().await;
    assert_eq!(list["object"], "list");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m", "m-alias"]);
    assert_eq!(list["data"][0]["object"], "model");
    assert_eq!(list["data"][0]["owned_by"], "kvmesh");
    assert!(list["data"][0]["created"].as_u64().is_some());

    let live = send(proxy.admin, Method::GET, "/live", &[], Bytes::new()).await;
    assert_eq!(live.status, 200);
    assert_eq!(live.json().await["status"], "live");
    let health = send(proxy.admin, Method::GET, "/health", &[], Bytes::new()).await;
    assert_eq!(health.status, 200);
    let health = health.json().await;
    assert_eq!(health["status"], "ok");
    assert_eq!(health["models"][0]["name"], "m");
    assert_eq!(
        health["models"][0]["instances"][0]["url"],
        backend.url.as_str()
    );

    chat(proxy.main, r#"{"model":"m"}"#)
        .await
        .text()
        .await
        .unwrap();
    // The exchange is counted just after its last byte is written: poll until it is.
    let counted = "kvmesh_requests_total{model=\"m\",protocol=\"http\",route=\"chat_completions\",status=\"200\"} 1";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let text = loop {
        let metrics = send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new()).await;
        assert_eq!(metrics.status, 200);
        let text = metrics.text().await.unwrap();
        if text.contains(counted) || tokio::time::Instant::now() >= deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    for needle in [
        counted,
        "kvmesh_requests_total{model=\"\",protocol=\"http\",route=\"models\",status=\"200\"} 1",
        "kvmesh_request_duration_seconds_bucket",
        "kvmesh_requests_in_flight{model=\"m\"} 0",
        "kvmesh_instance_in_flight",
        "kvmesh_instance_healthy",
        "kvmesh_time_to_first_token_seconds",
        "kvmesh_inter_token_latency_seconds",
        "kvmesh_upstream_errors_total",
        "kvmesh_client_errors_total",
    ] {
        assert!(text.contains(needle), "no {needle} in\n{text}");
    }
    let wrong = send(proxy.admin, Method::POST, "/metrics", &[], Bytes::new()).await;
    assert_eq!(wrong.status, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speaks_h2c_to_clients_and_engines() {
    let backend = Backend::start(|request| async move {
        let version = format!("{:?}", request.version);
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(full(format!(
                "data: {{\"version\":\"{version}\"}}\n\ndata: [DONE]\n\n"
            )))
            .unwrap()
    })
    .await;
    let yaml = model_yaml("m", &[&backend.url], "        protocol: h2c\n");
    let proxy = TestProxy::start(&yaml).await;
    let reply = send_h2c(
        proxy.main,
        "/v1/chat/completions",
        r#"{"model":"m","stream":true}"#,
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("x-kvmesh-instance"),
        Some(backend.url.as_str())
    );
    let text = reply.text().await.unwrap();
    assert_eq!(text, "data: {\"version\":\"HTTP/2.0\"}\n\ndata: [DONE]\n\n");
    // HTTP/1.1 clients on the same port still work.
    let reply = chat(proxy.main, r#"{"model":"m"}"#).await;
    assert_eq!(reply.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_a_stream_in_flight() {
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let release = std::sync::Mutex::new(Some(release_rx));
    let backend = Backend::start(move |request| {
        // Health probes reach the handler too: only the chat request takes the gate.
        let gate = (request.path == "/v1/chat/completions")
            .then(|| release.lock().unwrap().take())
            .flatten();
        async move {
            let (tx, body) = channel_body();
            tokio::spawn(async move {
                let _ = tx
                    .send(Ok(Bytes::from_static(b"data: {\"n\":1}\n\n")))
                    .await;
                if let Some(gate) = gate {
                    let _ = gate.await;
                }
                let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(body)
                .unwrap()
        }
    })
    .await;
    let yaml = format!(
        "{}shutdown:\n  drain_timeout: 10s\n",
        model_yaml("m", &[&backend.url], "")
    );
    let mut proxy = TestProxy::start(&yaml).await;
    let main = proxy.main;
    let mut reply = chat(main, r#"{"model":"m","stream":true}"#).await;
    reply.next_chunk().await.unwrap().unwrap();
    proxy.begin_shutdown();
    // New connections are refused once the listener is closed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while tokio::net::TcpStream::connect(main).await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "listener still open"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    release_tx.send(()).unwrap();
    assert_eq!(reply.text().await.unwrap(), "data: [DONE]\n\n");
    proxy.stopped().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_early_releases_the_instance() {
    let backend = Backend::start(|_| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Response::new(full("too late"))
    })
    .await;
    let yaml = format!(
        "{}health_check:\n  enabled: false\n",
        model_yaml("m", &[&backend.url], "")
    );
    let proxy = TestProxy::start(&yaml).await;
    let main = proxy.main;
    let client = tokio::spawn(async move { chat(main, r#"{"model":"m"}"#).await });
    let in_flight =
        |health: &serde_json::Value| health["models"][0]["instances"][0]["in_flight"].as_u64();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let health = send(proxy.admin, Method::GET, "/health", &[], Bytes::new())
            .await
            .json()
            .await;
        if in_flight(&health) == Some(1) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never in flight: {health}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    client.abort();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let health = send(proxy.admin, Method::GET, "/health", &[], Bytes::new())
            .await
            .json()
            .await;
        if in_flight(&health) == Some(0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still in flight: {health}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

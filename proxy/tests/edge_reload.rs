//! Config hot reload: under load no request fails, in-flight requests finish
//! on their config, a bad config is rejected while the old one keeps serving,
//! listeners cannot move, the retired state's health checks stop, and the
//! file watcher and `POST /reload` trigger reloads.

#[allow(dead_code)]
mod support;

mod edge_support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use edge_support::{CountingBackend, EdgeProxy, Reply, chat, plain};
use http::Method;
use kvmesh_e2e::ScratchDir;
use kvmesh_proxy::ReloadError;
use support::held_first;
use tokio::time::Instant;

fn yaml(backend: &CountingBackend, extra: &str) -> String {
    format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         health_check:\n  interval: 20ms\nreload:\n  watch: false\n{extra}\
         models:\n  - name: m\n    backends:\n      - url: http://{}\n",
        backend.addr
    )
}

async fn post(main: std::net::SocketAddr) -> Reply {
    plain(
        main,
        Method::POST,
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        chat("m"),
    )
    .await
}

fn write(path: &Path, text: &str) {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, text).unwrap();
    std::fs::rename(&temporary, path).unwrap();
}

#[tokio::test]
async fn a_reload_under_load_loses_no_request_and_a_bad_config_is_rejected() {
    let scratch = ScratchDir::new("reload-load").unwrap();
    let (a, b) = (
        CountingBackend::start("a").await,
        CountingBackend::start("b").await,
    );
    let file = scratch.write("proxy.yaml", &yaml(&a, "")).unwrap();
    let proxy = EdgeProxy::from_file(&file).await;

    let failures = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    // Each load task finishes the request it has in flight before it stops, so that no
    // request reaches a backend after the tasks are joined.
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..4 {
        let (failures, done, stop, main) = (
            Arc::clone(&failures),
            Arc::clone(&done),
            Arc::clone(&stop),
            proxy.main,
        );
        load.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if post(main).await.status == 200 {
                    done.fetch_add(1, Ordering::Relaxed);
                } else {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let wait_for = |n: usize| {
        let done = Arc::clone(&done);
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            while done.load(Ordering::Relaxed) < n {
                assert!(Instant::now() < deadline, "the load stalled");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    wait_for(20).await;
    for round in 0..3 {
        let target = if round % 2 == 0 { &b } else { &a };
        write(&file, &yaml(target, "limits:\n  max_body_bytes: 65536\n"));
        proxy.reload.reload().await.unwrap();
        wait_for(done.load(Ordering::Relaxed) + 20).await;
    }
    // Now on b; a broken config is refused and b keeps serving.
    write(&file, "models: [\n");
    let error = proxy.reload.reload().await.unwrap_err();
    assert!(matches!(error, ReloadError::Config(_)), "{error}");
    assert!(error.to_string().contains("proxy.yaml"), "{error}");
    write(&file, &yaml(&a, "limits:\n  max_body_bytes: 0\n"));
    let error = proxy.reload.reload().await.unwrap_err();
    assert!(
        error.to_string().contains("limits.max_body_bytes"),
        "{error}"
    );
    wait_for(done.load(Ordering::Relaxed) + 20).await;
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.unwrap();
    }
    assert_eq!(failures.load(Ordering::Relaxed), 0);
    let before = b.requests.load(Ordering::Relaxed);
    assert_eq!(post(proxy.main).await.json()["backend"], "b");
    assert_eq!(b.requests.load(Ordering::Relaxed), before + 1);
    assert_eq!(
        proxy
            .metric(r#"kvmesh_config_reloads_total{result="ok"}"#)
            .await,
        3.0
    );
    assert_eq!(
        proxy
            .metric(r#"kvmesh_config_reloads_total{result="rejected"}"#)
            .await,
        2.0
    );
    assert_eq!(
        proxy.metric("kvmesh_config_last_reload_successful").await,
        0.0
    );
    proxy.stop().await;
}

#[tokio::test]
async fn the_retired_states_health_checks_stop() {
    let scratch = ScratchDir::new("reload-retire").unwrap();
    let (a, b) = (
        CountingBackend::start("a").await,
        CountingBackend::start("b").await,
    );
    let file = scratch.write("proxy.yaml", &yaml(&a, "")).unwrap();
    let proxy = EdgeProxy::from_file(&file).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.probes.load(Ordering::Relaxed) < 2 {
        assert!(Instant::now() < deadline, "a is not probed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    write(&file, &yaml(&b, ""));
    proxy.reload.reload().await.unwrap();
    while b.probes.load(Ordering::Relaxed) < 2 {
        assert!(Instant::now() < deadline, "b is not probed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A probe may have been in flight at the swap; after that, none.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let settled = a.probes.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        a.probes.load(Ordering::Relaxed),
        settled,
        "a is still probed"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn listeners_cannot_move_and_code_configs_cannot_reload_a_file() {
    let scratch = ScratchDir::new("reload-listeners").unwrap();
    let a = CountingBackend::start("a").await;
    let file = scratch.write("proxy.yaml", &yaml(&a, "")).unwrap();
    let proxy = EdgeProxy::from_file(&file).await;
    let moved = yaml(&a, "").replace(
        "  - name: main\n    address: 127.0.0.1:0\n",
        "  - name: main\n    address: 127.0.0.1:1\n",
    );
    write(&file, &moved);
    let error = proxy.reload.reload().await.unwrap_err();
    assert!(matches!(error, ReloadError::Incompatible(_)), "{error}");
    assert!(error.to_string().contains("listeners[0]"), "{error}");
    assert_eq!(post(proxy.main).await.status, 200);
    proxy.stop().await;

    let in_code = EdgeProxy::from_yaml(&yaml(&a, "")).await;
    assert!(matches!(
        in_code.reload.reload().await,
        Err(ReloadError::NoFile)
    ));
    in_code.stop().await;
}

#[tokio::test]
async fn file_changes_and_post_reload_trigger_reloads() {
    let scratch = ScratchDir::new("reload-watch").unwrap();
    let (a, b) = (
        CountingBackend::start("a").await,
        CountingBackend::start("b").await,
    );
    let watched = |backend| {
        yaml(backend, "").replace("  watch: false\n", "  watch: true\n  poll_interval: 20ms\n")
    };
    let file = scratch.write("proxy.yaml", &watched(&a)).unwrap();
    let proxy = EdgeProxy::from_file(&file).await;
    assert_eq!(post(proxy.main).await.json()["backend"], "a");
    write(&file, &watched(&b));
    let deadline = Instant::now() + Duration::from_secs(10);
    while post(proxy.main).await.json()["backend"] != "b" {
        assert!(Instant::now() < deadline, "the file change was not applied");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Unchanged text is no reload.
    let reloads = proxy
        .metric(r#"kvmesh_config_reloads_total{result="ok"}"#)
        .await;
    assert_eq!(reloads, 1.0);

    let bad = watched(&a).replace("  poll_interval: 20ms\n", "  poll_interval: 0ms\n");
    let reply = plain(proxy.admin, Method::POST, "/reload", &[], Bytes::new()).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.json()["status"], "reloaded");
    let refused = {
        write(&file, &bad);
        // The watcher may get there first; either way the reload is refused.
        plain(proxy.admin, Method::POST, "/reload", &[], Bytes::new()).await
    };
    assert_eq!(refused.status, 400);
    assert_eq!(refused.json()["error"]["code"], "config_rejected");
    assert!(
        refused.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("reload.poll_interval")
    );
    assert_eq!(post(proxy.main).await.json()["backend"], "b");
    proxy.stop().await;
}

#[tokio::test]
async fn a_request_in_flight_finishes_on_the_config_it_started_with() {
    let scratch = ScratchDir::new("reload-in-flight").unwrap();
    let (tx, held) = held_first(Some("text/event-stream")).await;
    let b = CountingBackend::start("b").await;
    let config = |url: &str| {
        format!(
            "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
             health_check:\n  enabled: false\nreload:\n  watch: false\n\
             models:\n  - name: m\n    backends:\n      - url: {url}\n"
        )
    };
    let file = scratch.write("proxy.yaml", &config(&held.url)).unwrap();
    let proxy = EdgeProxy::from_file(&file).await;
    let streaming = tokio::spawn(post(proxy.main));
    let deadline = Instant::now() + Duration::from_secs(10);
    while held.requests().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the stream never reached its engine"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tx.send(Ok(Bytes::from_static(b"data: {\"n\":1}\n\n")))
        .await
        .unwrap();
    write(&file, &config(&format!("http://{}", b.addr)));
    proxy.reload.reload().await.unwrap();
    assert_eq!(post(proxy.main).await.json()["backend"], "b");
    tx.send(Ok(Bytes::from_static(b"data: {\"n\":2}\n\n")))
        .await
        .unwrap();
    drop(tx);
    let finished = streaming.await.unwrap();
    assert_eq!(finished.status, 200);
    let text = String::from_utf8_lossy(&finished.body).into_owned();
    assert!(
        text.contains("\"n\":1") && text.contains("\"n\":2"),
        "{text}"
    );
    assert_eq!(held.requests().len(), 1);
    proxy.stop().await;
}

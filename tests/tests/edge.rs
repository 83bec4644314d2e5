//! The edge with real processes: a SIGHUP reload under load loses no request
//! and a bad config is rejected while the old one serves; API keys never reach
//! the log; `hash-key` and `--check-config` for TLS files; a framing corpus of raw
//! bytes against the proxy in front of engine-sim (ambiguous framing, bad chunks, Host
//! and target tricks, control characters, huge chunk sizes, early answers read by a
//! client that writes its whole body first).

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::Method;
use kvmesh_e2e::certs::TestCerts;
use kvmesh_e2e::cluster::{chat_body, engine_urls, start_engines, start_proxy};
use kvmesh_e2e::process::bin_dir;
use kvmesh_e2e::{HttpClient, ScratchDir, Spawned};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY_FIRST: &str = "sk-e2e-first-4f1c0b";
const KEY_SECOND: &str = "sk-e2e-second-9a7b2d";
const KEY_WRONG: &str = "sk-e2e-wrong-5d2e8f";

/// `kvmesh-proxy hash-key` of `key`.
fn hash_key(key: &str) -> String {
    let mut child = Command::new(bin_dir().join("kvmesh-proxy"))
        .arg("hash-key")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "{key}").unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success());
    String::from_utf8(output.stdout).unwrap().trim().to_string()
}

fn config(engine: &str, keys: &[(&str, &str)]) -> String {
    let mut yaml = format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         reload:\n  watch: false\nmodels:\n  - name: sim-model\n    backends:\n      - url: {engine}\n\
         auth:\n  keys:\n"
    );
    for (name, key) in keys {
        yaml.push_str(&format!(
            "    - name: {name}\n      sha256: {}\n",
            hash_key(key)
        ));
    }
    yaml
}

/// Sends SIGHUP to the process.
fn hang_up(process: &Spawned) {
    let status = Command::new("kill")
        .arg("-HUP")
        .arg(process.pid().to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits until the admin metrics show `series` at `value`.
async fn await_metric(client: &HttpClient, admin: &str, series: &str, value: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = client.get(&format!("{admin}/metrics")).await.unwrap().body;
        let text = String::from_utf8_lossy(&text).into_owned();
        let found = text.lines().find_map(|line| {
            let (name, number) = line.rsplit_once(' ')?;
            (name == series).then(|| number.parse::<f64>().ok())?
        });
        if found == Some(value) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} never reached {value}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn hash_key_prints_the_sha256_of_stdin() {
    assert_eq!(
        hash_key("test"),
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    );
}

#[test]
fn check_config_reads_the_tls_files() {
    let scratch = ScratchDir::new("edge-check").unwrap();
    let certs = TestCerts::generate(scratch.path()).unwrap();
    let yaml = format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\n    tls:\n      cert: {}\n      key: {}\n\
         models:\n  - name: m\n    backends:\n      - url: http://127.0.0.1:1\n",
        certs.server_cert.display(),
        certs.client_key.display()
    );
    let file = scratch.write("proxy.yaml", &yaml).unwrap();
    let output = Command::new(bin_dir().join("kvmesh-proxy"))
        .arg("--check-config")
        .arg(&file)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("listeners[0].tls.key"), "{stderr}");
    assert!(
        stderr.contains(&certs.client_key.display().to_string()),
        "{stderr}"
    );
    let good = yaml.replace(
        &certs.client_key.display().to_string(),
        &certs.server_key.display().to_string(),
    );
    std::fs::write(&file, good).unwrap();
    let output = Command::new(bin_dir().join("kvmesh-proxy"))
        .arg("--check-config")
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_under_load_and_keys_never_reach_the_log() {
    let scratch = ScratchDir::new("edge-sighup").unwrap();
    let sim = start_engines(&scratch, 2, &["--no-delay"]).unwrap();
    let urls = engine_urls(&sim);
    let proxy = start_proxy(&scratch, &config(&urls[0], &[("first", KEY_FIRST)])).unwrap();
    let admin = proxy.url("admin");
    let chat_url = format!("{}/v1/chat/completions", proxy.url("main"));
    let client = HttpClient::http1();

    let failures = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut load = Vec::new();
    for worker in 0..3 {
        let (failures, done, stop, url) = (
            Arc::clone(&failures),
            Arc::clone(&done),
            Arc::clone(&stop),
            chat_url.clone(),
        );
        load.push(tokio::spawn(async move {
            let client = HttpClient::http1();
            let bearer = format!("Bearer {KEY_FIRST}");
            let stopped = stop.notified();
            tokio::pin!(stopped);
            for i in 0.. {
                let body = chat_body(&format!("worker {worker} request {i}"), 2, i % 2 == 0);
                let headers = [
                    ("content-type", "application/json"),
                    ("authorization", &bearer),
                ];
                let request = client.call(Method::POST, &url, &headers, body.to_string());
                tokio::select! {
                    _ = &mut stopped => return,
                    reply = request => match reply {
                        Ok(reply) if reply.status == 200 => done.fetch_add(1, Ordering::Relaxed),
                        _ => failures.fetch_add(1, Ordering::Relaxed),
                    },
                };
            }
        }));
    }
    let wait_for = |n: usize| {
        let done = Arc::clone(&done);
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while done.load(Ordering::Relaxed) < n {
                assert!(tokio::time::Instant::now() < deadline, "the load stalled");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    wait_for(20).await;

    // Move to the second engine and add a key.
    let next = config(&urls[1], &[("first", KEY_FIRST), ("second", KEY_SECOND)]);
    std::fs::write(scratch.path().join("proxy.yaml"), next).unwrap();
    hang_up(&proxy);
    await_metric(
        &client,
        &admin,
        r#"kvmesh_config_reloads_total{result="ok"}"#,
        1.0,
    )
    .await;
    wait_for(done.load(Ordering::Relaxed) + 20).await;
    let bearer = format!("Bearer {KEY_SECOND}");
    let headers = [
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
    ];
    let reply = client
        .call(
            Method::POST,
            &chat_url,
            &headers,
            chat_body("second key", 2, false).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-kvmesh-instance"), Some(urls[1].as_str()));

    // A broken config is rejected; the running one keeps serving.
    std::fs::write(scratch.path().join("proxy.yaml"), "models:\n  - nme: x\n").unwrap();
    hang_up(&proxy);
    await_metric(
        &client,
        &admin,
        r#"kvmesh_config_reloads_total{result="rejected"}"#,
        1.0,
    )
    .await;
    wait_for(done.load(Ordering::Relaxed) + 20).await;
    stop.notify_waiters();
    for task in load {
        task.await.unwrap();
    }
    assert_eq!(failures.load(Ordering::Relaxed), 0);

    let wrong = format!("Bearer {KEY_WRONG}");
    let headers = [
        ("content-type", "application/json"),
        ("authorization", wrong.as_str()),
    ];
    let reply = client
        .call(
            Method::POST,
            &chat_url,
            &headers,
            chat_body("x", 1, false).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 401);

    let mut proxy = proxy;
    proxy.terminate().unwrap();
    proxy.wait_exit(Duration::from_secs(30)).unwrap();
    let log = std::fs::read_to_string(proxy.log_path()).unwrap();
    assert!(log.contains("config reloaded"), "{log}");
    assert!(log.contains("config reload rejected"), "{log}");
    for key in [KEY_FIRST, KEY_SECOND, KEY_WRONG] {
        assert!(!log.contains(key), "the key {key} reached the log");
    }
}

/// Writes `head` and `body` bytes of `x` (the body in pieces, all of it before reading, as
/// Python's `urllib` does), then reads until the proxy closes the connection, which it must
/// do cleanly within 10 s.
async fn raw_exchange(addr: SocketAddr, head: &[u8], body: usize) -> String {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(head).await.unwrap();
    let piece = vec![b'x'; 1 << 20];
    let mut left = body;
    while left > 0 {
        let n = left.min(piece.len());
        tcp.write_all(&piece[..n])
            .await
            .expect("the proxy reads the rest of a body it answered early");
        left -= n;
    }
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(
        matches!(read, Ok(Ok(_))),
        "not closed cleanly ({read:?}): {:?} -> {answer:?}",
        String::from_utf8_lossy(head)
    );
    answer
}

/// The status and OpenAI error code of a whole answer (`""` when it has none).
fn status_and_code(answer: &str) -> (u16, String) {
    let status = answer.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    let json: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    (
        status,
        json["error"]["code"].as_str().unwrap_or("").to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_framing_corpus_against_engine_sim() {
    let scratch = ScratchDir::new("edge-framing").unwrap();
    let sim = start_engines(&scratch, 1, &["--no-delay"]).unwrap();
    let urls = engine_urls(&sim);
    let yaml = format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         limits:\n  max_body_bytes: 1048576\nmodels:\n  - name: sim-model\n    backends:\n      - url: {}\n",
        urls[0]
    );
    let proxy = start_proxy(&scratch, &yaml).unwrap();
    let main = proxy.addr("main");
    let body = chat_body("framing", 2, false).to_string();
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    let post =
        |fields: &str| format!("POST /v1/chat/completions HTTP/1.1\r\nHost: {main}\r\n{fields}");
    let length = format!("Content-Length: {}\r\n", body.len());
    let cases = [
        // (request, status, code)
        (
            format!(
                "{}Content-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n{chunked}",
                post(""),
                chunked.len()
            ),
            400,
            "invalid_framing",
        ),
        (
            format!(
                "{}Transfer-Encoding: chunked\r\n\r\nzz\r\n{body}\r\n0\r\n\r\n",
                post("")
            ),
            400,
            "invalid_framing",
        ),
        (
            format!(
                "{}Transfer-Encoding: chunked\r\n\r\n5;a=\0\r\nhello\r\n0\r\n\r\n",
                post("")
            ),
            400,
            "invalid_framing",
        ),
        (
            format!(
                "{}Transfer-Encoding: chunked\r\n\r\n1ffffffffffffffff\r\n",
                post("")
            ),
            400,
            "invalid_framing",
        ),
        (
            format!(
                "{}Transfer-Encoding: chunked\r\n\r\nffffffffff\r\n",
                post("")
            ),
            413,
            "request_too_large",
        ),
        (
            format!("{}Transfer-Encoding: xchunked\r\n\r\n{chunked}", post("")),
            400,
            "invalid_framing",
        ),
        (
            format!("{}Host: {main}\r\n{length}\r\n{body}", post("")),
            400,
            "invalid_framing",
        ),
        (
            format!("POST /v1/chat/completions HTTP/1.1\r\n{length}\r\n{body}"),
            400,
            "invalid_framing",
        ),
        (
            format!(
                "POST http://other/v1/chat/completions HTTP/1.1\r\nHost: {main}\r\n{length}\r\n{body}"
            ),
            400,
            "invalid_framing",
        ),
        (
            format!("{}X-Note: a\x01b\r\n{length}\r\n{body}", post("")),
            400,
            "malformed_request",
        ),
        (
            format!("{}Transfer-Encoding : chunked\r\n\r\n{chunked}", post("")),
            400,
            "malformed_request",
        ),
        // Served: chunked, and an absolute-form target (both forwarded by length and path).
        (
            format!(
                "{}Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n{chunked}",
                post("")
            ),
            200,
            "",
        ),
        (
            format!(
                "POST http://{main}/v1/chat/completions HTTP/1.1\r\nHost: {main}\r\nConnection: close\r\n{length}\r\n{body}"
            ),
            200,
            "",
        ),
    ];
    for (request, status, code) in &cases {
        let answer = raw_exchange(main, request.as_bytes(), 0).await;
        assert_eq!(
            status_and_code(&answer),
            (*status, code.to_string()),
            "{request:?} -> {answer}"
        );
        if *status == 200 {
            assert!(answer.contains("\"chat.completion\""), "{answer}");
        }
    }
    // A body over the limit, written whole before the answer is read: the 413 is read.
    let head = post(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        24 << 20
    ));
    let answer = raw_exchange(main, head.as_bytes(), 24 << 20).await;
    assert_eq!(
        status_and_code(&answer),
        (413, "request_too_large".into()),
        "{answer}"
    );

    let client = HttpClient::http1();
    let admin = proxy.url("admin");
    let metrics = client.get(&format!("{admin}/metrics")).await.unwrap().body;
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    for (reason, count) in [
        ("content_length_and_transfer_encoding", 1),
        ("chunk", 3),
        ("transfer_encoding", 1),
        ("host", 2),
        ("target", 1),
    ] {
        let series = format!(
            r#"kvmesh_framing_rejections_total{{peer="client",reason="{reason}"}} {count}"#
        );
        assert!(metrics.contains(&series), "{series} in {metrics}");
    }
}

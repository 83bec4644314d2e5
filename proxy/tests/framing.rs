//! A strict HTTP/1.1 edge at the byte level, on the fast path in plaintext and over TLS (the
//! same rules, the same counts): requests that frame their body ambiguously, name no single
//! Host or a target in no valid form get 400 and a closed connection, and never reach an
//! engine; chunked bodies are held to RFC 9112's grammar; absolute-form targets are served by
//! their path; and an answer that comes before the body was read is followed by a lingering
//! close, so that a client writing its whole body first still reads it.

#[allow(dead_code)]
mod support;

mod edge_support;

use std::future::Future;
use std::time::Duration;

use edge_support::{EdgeProxy, TlsClient};
use kvmesh_e2e::ScratchDir;
use kvmesh_e2e::certs::TestCerts;
use support::Backend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout};

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

/// Longest wait for the proxy to answer and close.
const DEADLINE: Duration = Duration::from_secs(10);

/// A config with a plaintext (or, with `certs`, TLS) listener and one model on `backend`.
fn yaml(backend: &str, certs: Option<&TestCerts>, extra: &str) -> String {
    let tls = certs.map_or_else(String::new, |certs| {
        format!(
            "    tls:\n      cert: {}\n      key: {}\n",
            certs.server_cert.display(),
            certs.server_key.display()
        )
    });
    format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\n{tls}admin:\n  address: 127.0.0.1:0\n\
         health_check:\n  enabled: false\nmodels:\n  - name: m\n    backends:\n      - url: {backend}\n{extra}"
    )
}

/// `body` in one chunk, with an extension and a trailer.
fn chunked(body: &str) -> String {
    format!(
        "{:x};ext=\"v\"\r\n{body}\r\n0\r\nx-trailer: 1\r\n\r\n",
        body.len()
    )
}

/// Writes `raw`, then reads until the proxy closes the connection, which it must do cleanly
/// (no reset) within [`DEADLINE`].
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, raw: &[u8]) -> String {
    stream
        .write_all(raw)
        .await
        .expect("the proxy takes the request");
    let mut answer = Vec::new();
    let read = timeout(DEADLINE, stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(
        matches!(read, Ok(Ok(_))),
        "the connection was not closed cleanly ({read:?}): {:?} -> {answer:?}",
        String::from_utf8_lossy(raw)
    );
    answer
}

/// The status and the error code of a whole answer.
fn status_and_code(answer: &str) -> (u16, String) {
    let status = answer
        .get(9..12)
        .and_then(|status| status.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    let json: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let code = json["error"]["code"].as_str().unwrap_or("").to_string();
    (status, code)
}

/// Asserts that `answer` is a 400 with `code` that closes the connection.
fn assert_refused(answer: &str, code: &str, request: &str) {
    assert_eq!(
        status_and_code(answer),
        (400, code.to_string()),
        "{request:?} -> {answer:?}"
    );
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("connection: close\r\n"),
        "{answer:?}"
    );
}

/// Requests refused on every listener, whatever path: the head, the `invalid_framing`
/// reason they are counted under (`None`: the parser refuses them, `malformed_request`).
fn refused_heads(host: &str) -> Vec<(String, Option<&'static str>)> {
    let chat = |fields: &str, body: &str| {
        format!("POST /v1/chat/completions HTTP/1.1\r\n{fields}\r\n{body}")
    };
    let body = chunked(CHAT);
    let h = format!("Host: {host}\r\n");
    vec![
        (
            chat(
                &format!(
                    "{h}Content-Length: {}\r\nTransfer-Encoding: chunked\r\n",
                    body.len()
                ),
                &body,
            ),
            Some("content_length_and_transfer_encoding"),
        ),
        (
            chat(
                &format!("{h}Transfer-Encoding: chunked\r\nContent-Length: 4\r\n"),
                &body,
            ),
            Some("content_length_and_transfer_encoding"),
        ),
        (
            chat(&format!("{h}Transfer-Encoding: xchunked\r\n"), &body),
            Some("transfer_encoding"),
        ),
        (
            chat(
                &format!("{h}Transfer-Encoding: chunked, identity\r\n"),
                &body,
            ),
            Some("transfer_encoding"),
        ),
        (
            chat(&format!("{h}Transfer-Encoding: gzip, chunked\r\n"), &body),
            Some("transfer_encoding"),
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n{body}"
            ),
            Some("transfer_encoding"),
        ),
        (
            chat(
                &format!("{h}Content-Length: 5\r\nContent-Length: 6\r\n"),
                "hello!",
            ),
            Some("content_length"),
        ),
        (
            chat(&format!("{h}Content-Length: +{}\r\n", CHAT.len()), CHAT),
            Some("content_length"),
        ),
        (
            chat(&format!("{h}Content_Length: {}\r\n", CHAT.len()), CHAT),
            Some("content_length"),
        ),
        (
            chat(&format!("{h}{h}Content-Length: {}\r\n", CHAT.len()), CHAT),
            Some("host"),
        ),
        (
            chat(&format!("Content-Length: {}\r\n", CHAT.len()), CHAT),
            Some("host"),
        ),
        (
            format!(
                "POST http://elsewhere/v1/chat/completions HTTP/1.1\r\n{h}Content-Length: {}\r\n\r\n{CHAT}",
                CHAT.len()
            ),
            Some("target"),
        ),
        (
            format!(
                "GET /v1/models HTTP/1.1\r\n{h}Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            ),
            Some("content_length_and_transfer_encoding"),
        ),
        (
            chat(&format!("{h}Transfer-Encoding : chunked\r\n"), &body),
            None,
        ),
        (
            chat(
                &format!("{h}X-Note: a\x01b\r\nContent-Length: {}\r\n", CHAT.len()),
                CHAT,
            ),
            None,
        ),
        (
            chat(
                &format!("{h}X-Note: a\0b\r\nContent-Length: {}\r\n", CHAT.len()),
                CHAT,
            ),
            None,
        ),
        (
            chat(
                &format!("{h}X-Note: a\r\n Transfer-Encoding: chunked\r\n"),
                &body,
            ),
            None,
        ),
    ]
}

/// Chunked bodies refused: what follows the head, and whether the answer is 413 (the
/// chunk is announced over the limit) rather than 400.
fn refused_chunks() -> Vec<(&'static str, bool)> {
    vec![
        ("zz\r\n", false),
        ("\r\nxx\r\n0\r\n\r\n", false),
        ("+5\r\nhello\r\n0\r\n\r\n", false),
        ("0x5\r\nhello\r\n0\r\n\r\n", false),
        ("5;\0\r\nhello\r\n0\r\n\r\n", false),
        ("5\r\nhelloXY0\r\n\r\n", false),
        ("5\nhello\n0\n\n", false),
        ("fffffffffffffffff\r\n", false),
        ("ffffffffff\r\n", true),
    ]
}

/// Sends every refused head and chunked body to `proxy` (each on a fresh connection from
/// `connect`, naming `host`), and asserts each is refused with the connection closed, that
/// none reached `backend`, and the exact counts of each reason.
async fn refuses_every_ambiguous_request<S, F, C>(
    proxy: &EdgeProxy,
    backend: &Backend,
    host: &str,
    connect: C,
) where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Future<Output = S>,
    C: Fn() -> F,
{
    let mut expected = std::collections::BTreeMap::new();
    for (request, reason) in refused_heads(host) {
        let answer = exchange(connect().await, request.as_bytes()).await;
        let code = reason.map_or("malformed_request", |_| "invalid_framing");
        assert_refused(&answer, code, &request);
        if let Some(reason) = reason {
            *expected.entry(reason).or_insert(0.0) += 1.0;
        }
    }
    for (chunks, too_large) in refused_chunks() {
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n{chunks}"
        );
        let answer = exchange(connect().await, request.as_bytes()).await;
        if too_large {
            assert_eq!(status_and_code(&answer).1, "request_too_large", "{answer}");
        } else {
            assert_refused(&answer, "invalid_framing", &request);
            *expected.entry("chunk").or_insert(0.0) += 1.0;
        }
    }
    assert!(backend.requests().is_empty(), "nothing reached the engine");
    for (reason, count) in &expected {
        let series =
            format!(r#"kvmesh_framing_rejections_total{{peer="client",reason="{reason}"}}"#);
        assert_eq!(proxy.metric(&series).await, *count, "{reason}");
    }
    let total: f64 = expected.values().sum();
    assert_eq!(
        proxy
            .metric(r#"kvmesh_client_errors_total{reason="invalid_framing"}"#)
            .await,
        total
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_requests_get_400_and_a_closed_connection() {
    let backend = Backend::ok().await;
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, None, "")).await;
    let host = proxy.main.to_string();
    let connect = || async { TcpStream::connect(proxy.main).await.unwrap() };
    refuses_every_ambiguous_request(&proxy, &backend, &host, connect).await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_chunk_line_is_answered_before_the_line_ends() {
    let backend = Backend::ok().await;
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, None, "")).await;
    let mut tcp = TcpStream::connect(proxy.main).await.unwrap();
    // `zz` can start no chunk-size line; the client sends nothing more and keeps the
    // connection open: the answer comes now, not at the 30 s client timeout.
    let started = Instant::now();
    tcp.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nTransfer-Encoding: chunked\r\n\r\nzz",
            proxy.main
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut answer = vec![0; 4096];
    let read = timeout(DEADLINE, tcp.read(&mut answer))
        .await
        .unwrap()
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]).into_owned();
    assert_refused(&answer, "invalid_framing", "zz");
    assert!(started.elapsed() < DEADLINE);
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_and_absolute_form_requests_are_forwarded_by_length_and_path() {
    let backend = Backend::ok().await;
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, None, "")).await;
    let host = proxy.main.to_string();
    let mut tcp = TcpStream::connect(proxy.main).await.unwrap();
    let chunked_request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n{}",
        chunked(CHAT)
    );
    let absolute_request = format!(
        "POST http://{host}/v1/chat/completions?x=1 HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\nconnection: close\r\n\r\n{CHAT}",
        CHAT.len()
    );
    // Both on one connection: the chunked body was read to its exact end.
    let answer = exchange(
        &mut tcp,
        format!("{chunked_request}{absolute_request}").as_bytes(),
    )
    .await;
    assert_eq!(answer.matches("HTTP/1.1 200 OK\r\n").count(), 2, "{answer}");
    let requests = backend.requests();
    assert_eq!(requests.len(), 2);
    for (request, path) in requests
        .iter()
        .zip(["/v1/chat/completions", "/v1/chat/completions?x=1"])
    {
        assert_eq!(request.path, path);
        assert_eq!(request.body, CHAT.as_bytes());
        assert_eq!(
            request.headers["content-length"],
            CHAT.len().to_string().as_str()
        );
        assert!(!request.headers.contains_key("transfer-encoding"));
        assert!(!request.headers.contains_key("x-trailer"));
    }
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listeners_hold_requests_to_the_same_rules() {
    let scratch = ScratchDir::new("framing-tls").unwrap();
    let certs = TestCerts::generate(scratch.path()).unwrap();
    let backend = Backend::ok().await;
    let proxy = EdgeProxy::from_yaml(&yaml(&backend.url, Some(&certs), "")).await;
    let client = TlsClient::http1_only(&certs.ca);
    let connect = || client.connect(proxy.main);
    refuses_every_ambiguous_request(&proxy, &backend, "localhost", connect).await;
    // A good chunked request is served by length, and its connection goes on: the strict
    // decoder read the body to its exact end.
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n{}\
         POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{CHAT}",
        chunked(CHAT),
        CHAT.len()
    );
    let answer = exchange(client.connect(proxy.main).await, request.as_bytes()).await;
    assert_eq!(answer.matches("HTTP/1.1 200 OK\r\n").count(), 2, "{answer}");
    let requests = backend.requests();
    assert_eq!(requests.len(), 2);
    assert!(requests.iter().all(|r| r.body == CHAT.as_bytes()));
    proxy.stop().await;
}

/// Sends a head announcing `body` bytes, writes all of them before reading (as Python's
/// `urllib` does), then reads the answer until the proxy closes.
async fn write_everything_then_read<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    head: &str,
    body: usize,
) -> String {
    stream.write_all(head.as_bytes()).await.unwrap();
    let piece = vec![b'x'; 1 << 20];
    let mut left = body;
    while left > 0 {
        let n = left.min(piece.len());
        stream
            .write_all(&piece[..n])
            .await
            .expect("the proxy reads what the client still sends after its early answer");
        left -= n;
    }
    exchange(stream, b"").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_write_their_whole_body_first_read_early_answers() {
    // Far more than the socket buffers hold: without the lingering close the proxy's close
    // resets the connection while the body is still being written.
    const BODY: usize = 24 << 20;
    let scratch = ScratchDir::new("framing-linger").unwrap();
    let certs = TestCerts::generate(scratch.path()).unwrap();
    let backend = Backend::ok().await;
    let limits = "limits:\n  max_body_bytes: 1048576\n";
    let plain = EdgeProxy::from_yaml(&yaml(&backend.url, None, limits)).await;
    let tls = EdgeProxy::from_yaml(&yaml(&backend.url, Some(&certs), limits)).await;
    let auth = "auth:\n  keys:\n    - name: a\n      sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n";
    let keyed = EdgeProxy::from_yaml(&yaml(&backend.url, None, auth)).await;
    let head = |host: &str| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
             Content-Length: {BODY}\r\nConnection: close\r\n\r\n"
        )
    };

    let tcp = TcpStream::connect(plain.main).await.unwrap();
    let answer = write_everything_then_read(tcp, &head(&plain.main.to_string()), BODY).await;
    assert_eq!(
        status_and_code(&answer),
        (413, "request_too_large".into()),
        "{answer}"
    );

    let stream = TlsClient::http1_only(&certs.ca).connect(tls.main).await;
    let answer = write_everything_then_read(stream, &head("localhost"), BODY).await;
    assert_eq!(
        status_and_code(&answer),
        (413, "request_too_large".into()),
        "{answer}"
    );

    let tcp = TcpStream::connect(keyed.main).await.unwrap();
    let answer = write_everything_then_read(tcp, &head(&keyed.main.to_string()), BODY).await;
    assert_eq!(
        status_and_code(&answer),
        (401, "missing_api_key".into()),
        "{answer}"
    );

    assert!(backend.requests().is_empty());
    plain.stop().await;
    tls.stop().await;
    keyed.stop().await;
}

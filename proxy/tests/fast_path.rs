//! The HTTP/1.1 fast path at the byte level: raw TCP clients and engines, so what each side
//! receives, in how many reads, and how the connection is handed to pingora can be checked.

#[allow(dead_code)]
mod support;

mod edge_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use support::{TestProxy, model_yaml};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc};

const BODY: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

/// A chat request with `extra` header lines.
fn chat_request(extra: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{BODY}",
        BODY.len()
    )
}

/// A proxy with one model on `engine` (no health probes: the engines count every read).
async fn proxy_for(engine: SocketAddr) -> TestProxy {
    let yaml = model_yaml("m", &[&format!("http://{engine}")], "");
    TestProxy::start(&format!("health_check:\n  enabled: false\n{yaml}")).await
}

/// An engine that answers every request on every connection with `response`, and reports
/// what the first read of each request returned.
async fn raw_engine(response: &'static [u8]) -> (SocketAddr, mpsc::UnboundedReceiver<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                loop {
                    let n = match tcp.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let _ = tx.send(buf[..n].to_vec());
                    if tcp.write_all(response).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// A client connection that keeps what it read past one response for the next.
struct Client {
    tcp: TcpStream,
    read: Vec<u8>,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Self {
        let tcp = TcpStream::connect(addr).await.unwrap();
        tcp.set_nodelay(true).unwrap();
        Self {
            tcp,
            read: Vec::new(),
        }
    }

    async fn send(&mut self, request: &str) {
        self.tcp.write_all(request.as_bytes()).await.unwrap();
    }

    /// Reads one whole response (Content-Length or chunked); returns its head and decoded
    /// body, and how many reads it took.
    async fn response(&mut self) -> (String, String, usize) {
        let mut reads = 0;
        let mut buf = vec![0; 64 * 1024];
        loop {
            if let Some((head, body, used)) = parse_response(&self.read) {
                self.read.drain(..used);
                return (head, body, reads);
            }
            let n = self.tcp.read(&mut buf).await.unwrap();
            assert!(
                n > 0,
                "connection closed mid-response: {:?}",
                String::from_utf8_lossy(&self.read)
            );
            self.read.extend_from_slice(&buf[..n]);
            reads += 1;
        }
    }
}

/// The head, decoded body and length of the whole response at the start of `raw`, if it
/// is all there.
fn parse_response(raw: &[u8]) -> Option<(String, String, usize)> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8(raw[..end].to_vec()).unwrap();
    let rest = &raw[end..];
    let lower = head.to_ascii_lowercase();
    if let Some(length) = lower
        .lines()
        .find_map(|line| line.strip_prefix("content-length: "))
    {
        let length: usize = length.trim().parse().unwrap();
        let body = rest.get(..length)?;
        return Some((
            head,
            String::from_utf8(body.to_vec()).unwrap(),
            end + length,
        ));
    }
    assert!(lower.contains("transfer-encoding: chunked"), "{head}");
    let (body, used) = dechunk(rest)?;
    Some((head, body, end + used))
}

/// The body of a complete chunked encoding and its encoded length, `None` while incomplete.
fn dechunk(all: &[u8]) -> Option<(String, usize)> {
    let mut raw = all;
    let mut body = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&raw[..line_end]).ok()?, 16).ok()?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            let used = all.len() - raw.len() + 2;
            return raw
                .starts_with(b"\r\n")
                .then(|| (String::from_utf8(body).unwrap(), used));
        }
        if raw.len() < size + 2 {
            return None;
        }
        body.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_and_body_travel_together_in_both_directions() {
    let (engine, mut seen) = raw_engine(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: keep-alive\r\nx-request-id: engine\r\ncontent-length: 11\r\n\r\n{\"ok\":true}",
    )
    .await;
    let proxy = proxy_for(engine).await;
    let mut client = Client::connect(proxy.main).await;
    for i in 0..3 {
        let request = chat_request(&format!(
            "x-request-id: req-{i}\r\nconnection: keep-alive\r\n"
        ));
        client.send(&request).await;
        let (head, body, reads) = client.response().await;
        assert_eq!(body, "{\"ok\":true}");
        assert_eq!(
            reads, 1,
            "the response head and body arrive in one read: {head}"
        );
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(
            head.contains(&format!("x-request-id: req-{i}\r\n")),
            "{head}"
        );
        assert!(!head.contains("x-request-id: engine"), "{head}");
        assert!(
            !head.to_ascii_lowercase().contains("connection: keep-alive"),
            "{head}"
        );
        assert!(
            head.contains(&format!("x-kvmesh-instance: http://{engine}\r\n")),
            "{head}"
        );

        let received = String::from_utf8(seen.recv().await.unwrap()).unwrap();
        assert!(
            received.ends_with(BODY),
            "head and body reach the engine in one read: {received:?}"
        );
        let lower = received.to_ascii_lowercase();
        assert!(lower.contains(&format!("host: {engine}\r\n")), "{received}");
        assert!(
            lower.contains(&format!("x-request-id: req-{i}\r\n")),
            "{received}"
        );
        assert!(
            !lower.contains("connection:"),
            "hop-by-hop fields stay behind: {received}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_moves_to_pingora_for_other_requests() {
    let (engine, _seen) = raw_engine(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
    let proxy = proxy_for(engine).await;
    let mut client = Client::connect(proxy.main).await;
    // Fast path, then a model list (handed over with the bytes already read), then pingora
    // serves the rest of the connection.
    client.send(&chat_request("")).await;
    assert_eq!(client.response().await.1, "ok");
    client
        .send("GET /v1/models HTTP/1.1\r\nhost: proxy\r\n\r\n")
        .await;
    let (head, models, _) = client.response().await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(models.contains("\"id\":\"m\""), "{models}");
    client.send(&chat_request("")).await;
    assert_eq!(client.response().await.1, "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let (engine, _seen) = raw_engine(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
    let proxy = proxy_for(engine).await;
    let mut client = Client::connect(proxy.main).await;
    let two = format!(
        "{}{}",
        chat_request("x-request-id: first\r\n"),
        chat_request("x-request-id: second\r\n")
    );
    client.send(&two).await;
    for id in ["first", "second"] {
        let (head, body, _) = client.response().await;
        assert_eq!(body, "ok");
        assert!(head.contains(&format!("x-request-id: {id}\r\n")), "{head}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_delimited_engine_bodies_reach_clients_chunked() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut tcp, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                let _ = tcp.read(&mut buf).await;
                let _ = tcp
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"part\":1,",
                    )
                    .await;
                let _ = tcp.write_all(b"\"end\":true}").await;
            });
        }
    });
    let proxy = proxy_for(engine).await;
    let mut client = Client::connect(proxy.main).await;
    for _ in 0..2 {
        client.send(&chat_request("")).await;
        let (head, body, _) = client.response().await;
        assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
        assert_eq!(body, "{\"part\":1,\"end\":true}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_engine_responses_are_502_and_their_connections_closed() {
    let cases: [(&'static [u8], &str); 3] = [
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            "content_length_and_transfer_encoding",
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 5\r\n\r\nhello",
            "content_length",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nhello",
            "transfer_encoding",
        ),
    ];
    for (response, reason) in cases {
        let (engine, connections) = scripted_engine(vec![response], Arc::default()).await;
        let proxy = proxy_for(engine).await;
        let mut client = Client::connect(proxy.main).await;
        for _ in 0..2 {
            client.send(&chat_request("")).await;
            let (head, body, _) = client.response().await;
            assert!(head.starts_with("HTTP/1.1 502 "), "{head}");
            assert!(body.contains("\"upstream_unavailable\""), "{body}");
            assert!(body.contains("malformed response head"), "{body}");
        }
        assert_eq!(
            connections.load(Ordering::SeqCst),
            2,
            "{reason}: a connection that carried a malformed response is not reused"
        );
        let series =
            format!(r#"kvmesh_framing_rejections_total{{peer="engine",reason="{reason}"}}"#);
        assert_eq!(edge_support::metric(proxy.admin, &series).await, 2.0);
    }
}

/// An engine that answers every request with `parts` in turn, each after the first once
/// `next` is notified (the test saw the previous one arrive: a response whose body goes wrong
/// after its start), and counts its connections.
async fn scripted_engine(
    parts: Vec<&'static [u8]>,
    next: Arc<Notify>,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let accepted = Arc::clone(&connections);
    tokio::spawn(async move {
        loop {
            let (mut tcp, _) = listener.accept().await.unwrap();
            accepted.fetch_add(1, Ordering::SeqCst);
            let (parts, next) = (parts.clone(), Arc::clone(&next));
            tokio::spawn(async move {
                let mut buf = vec![0; 64 * 1024];
                while matches!(tcp.read(&mut buf).await, Ok(n) if n > 0) {
                    for (i, part) in parts.iter().enumerate() {
                        if i > 0 {
                            next.notified().await;
                        }
                        if tcp.write_all(part).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, connections)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_body_framed_wrongly_after_its_start_cuts_the_response_and_its_connection() {
    let next = Arc::new(Notify::new());
    let (engine, connections) = scripted_engine(
        vec![
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
            b"5;\0\r\nworld\r\n0\r\n\r\n",
        ],
        Arc::clone(&next),
    )
    .await;
    let proxy = proxy_for(engine).await;
    for attempt in 1..=2 {
        let mut tcp = TcpStream::connect(proxy.main).await.unwrap();
        tcp.write_all(chat_request("").as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let mut buf = [0; 4096];
        // The bad chunk is sent once the first piece has reached the client.
        while !String::from_utf8_lossy(&answer).contains("hello") {
            let n = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buf))
                .await
                .expect("the first piece arrives")
                .unwrap();
            assert!(n > 0, "cut before the first piece: {answer:?}");
            answer.extend_from_slice(&buf[..n]);
        }
        next.notify_one();
        let read = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer))
            .await
            .expect("the client connection is cut");
        // The head and the first piece left before the bad chunk came: the body is cut short.
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200 "), "{answer:?}");
        assert!(answer.contains("hello"), "{answer:?}");
        assert!(
            read.is_err() || !answer.ends_with("0\r\n\r\n"),
            "the body is not ended as if it were whole: {answer:?}"
        );
        assert!(!answer.contains("world"), "{answer:?}");
        assert_eq!(connections.load(Ordering::SeqCst), attempt);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_body_framed_wrongly_within_what_came_with_its_head_is_502() {
    // A bad chunk line right behind a good chunk, read with the head: nothing has left yet.
    let (engine, connections) = scripted_engine(
        vec![b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n5;\0\r\nworld\r\n0\r\n\r\n"],
        Arc::default(),
    )
    .await;
    let proxy = proxy_for(engine).await;
    let mut client = Client::connect(proxy.main).await;
    for attempt in 1..=2 {
        client.send(&chat_request("")).await;
        let (head, body, _) = client.response().await;
        assert!(head.starts_with("HTTP/1.1 502 "), "{head}");
        assert!(body.contains("\"upstream_unavailable\""), "{body}");
        assert!(body.contains("malformed body"), "{body}");
        assert!(!body.contains("hello"), "{body}");
        assert_eq!(
            connections.load(Ordering::SeqCst),
            attempt,
            "the engine connection that carried it is not reused"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http10_requests_go_to_pingora_and_expect_gets_100_continue_or_a_413() {
    let (engine, _seen) = raw_engine(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
    let proxy = proxy_for(engine).await;

    let mut old = TcpStream::connect(proxy.main).await.unwrap();
    let request = chat_request("").replacen("HTTP/1.1", "HTTP/1.0", 1);
    old.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    old.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8(answer).unwrap();
    assert!(
        answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200"),
        "{answer}"
    );
    assert!(answer.ends_with("ok"), "{answer}");

    let mut expecting = Client::connect(proxy.main).await;
    let head = chat_request("expect: 100-continue\r\n");
    let (head, body) = head.split_at(head.len() - BODY.len());
    expecting.send(head).await;
    let mut buf = vec![0; 1024];
    let n = expecting.tcp.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 100"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    expecting.send(body).await;
    assert_eq!(expecting.response().await.1, "ok");

    // A body announced over the limit is refused without a 100 asking for it.
    let mut refused = Client::connect(proxy.main).await;
    let too_large = chat_request("expect: 100-continue\r\n").replacen(
        &format!("content-length: {}", BODY.len()),
        "content-length: 999999999999",
        1,
    );
    let (head, _) = too_large.split_at(too_large.len() - BODY.len());
    refused.send(head).await;
    let n = refused.tcp.read(&mut buf).await.unwrap();
    let answer = String::from_utf8_lossy(&buf[..n]);
    assert!(answer.starts_with("HTTP/1.1 413 "), "{answer}");
}

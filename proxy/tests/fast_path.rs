//! The HTTP/1.1 fast path at the byte level: raw TCP clients and engines, so what each side
//! receives, in how many reads, and how the connection is handed to pingora can be checked.

#[allow(dead_code)]
mod support;

use std::net::SocketAddr;

use support::{TestProxy, model_yaml};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

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

/// Reads one whole response (Content-Length or chunked) from `tcp`; returns its head and
/// decoded body, and how many reads it took.
async fn read_response(tcp: &mut TcpStream) -> (String, String, usize) {
    let mut raw = Vec::new();
    let mut reads = 0;
    let mut buf = vec![0; 64 * 1024];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8(raw[..end + 4].to_vec()).unwrap();
            let rest = &raw[end + 4..];
            let lower = head.to_ascii_lowercase();
            if let Some(length) = lower
                .lines()
                .find_map(|line| line.strip_prefix("content-length: "))
            {
                let length: usize = length.trim().parse().unwrap();
                if rest.len() >= length {
                    let body = String::from_utf8(rest[..length].to_vec()).unwrap();
                    return (head, body, reads);
                }
            } else if lower.contains("transfer-encoding: chunked")
                && let Some(body) = dechunk(rest)
            {
                return (head, body, reads);
            }
        }
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "connection closed mid-response: {:?}",
            String::from_utf8_lossy(&raw)
        );
        raw.extend_from_slice(&buf[..n]);
        reads += 1;
    }
}

/// The body of a complete chunked encoding, `None` while incomplete.
fn dechunk(mut raw: &[u8]) -> Option<String> {
    let mut body = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&raw[..line_end]).ok()?, 16).ok()?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return raw
                .starts_with(b"\r\n")
                .then(|| String::from_utf8(body).unwrap());
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
    let mut client = TcpStream::connect(proxy.main).await.unwrap();
    client.set_nodelay(true).unwrap();
    for i in 0..3 {
        let request = chat_request(&format!(
            "x-request-id: req-{i}\r\nconnection: keep-alive\r\n"
        ));
        client.write_all(request.as_bytes()).await.unwrap();
        let (head, body, reads) = read_response(&mut client).await;
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
    let mut client = TcpStream::connect(proxy.main).await.unwrap();
    // Fast path, then a model list (handed over with the bytes already read), then pingora
    // serves the rest of the connection.
    client.write_all(chat_request("").as_bytes()).await.unwrap();
    assert_eq!(read_response(&mut client).await.1, "ok");
    client
        .write_all(b"GET /v1/models HTTP/1.1\r\nhost: proxy\r\n\r\n")
        .await
        .unwrap();
    let (head, models, _) = read_response(&mut client).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(models.contains("\"id\":\"m\""), "{models}");
    client.write_all(chat_request("").as_bytes()).await.unwrap();
    assert_eq!(read_response(&mut client).await.1, "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let (engine, _seen) = raw_engine(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
    let proxy = proxy_for(engine).await;
    let mut client = TcpStream::connect(proxy.main).await.unwrap();
    let two = format!(
        "{}{}",
        chat_request("x-request-id: first\r\n"),
        chat_request("x-request-id: second\r\n")
    );
    client.write_all(two.as_bytes()).await.unwrap();
    for id in ["first", "second"] {
        let (head, body, _) = read_response(&mut client).await;
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
    let mut client = TcpStream::connect(proxy.main).await.unwrap();
    for _ in 0..2 {
        client.write_all(chat_request("").as_bytes()).await.unwrap();
        let (head, body, _) = read_response(&mut client).await;
        assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
        assert_eq!(body, "{\"part\":1,\"end\":true}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http10_and_expect_requests_are_served_by_pingora() {
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

    let mut expecting = TcpStream::connect(proxy.main).await.unwrap();
    let head = chat_request("expect: 100-continue\r\n");
    let (head, body) = head.split_at(head.len() - BODY.len());
    expecting.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0; 1024];
    let n = expecting.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 100"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    expecting.write_all(body.as_bytes()).await.unwrap();
    assert_eq!(read_response(&mut expecting).await.1, "ok");
}

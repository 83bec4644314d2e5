//! Fuzz-style tests (proptest): whatever a client sends as a request head or
//! body, and whatever header names and values reach the header code, nothing
//! panics.

use std::time::Duration;

use http::{HeaderName, HeaderValue, Version};
use kvmesh_config::LimitsConfig;
use pingora_core::protocols::http::ServerSession;
use pingora_http::{RequestHeader, ResponseHeader};
use proptest::prelude::*;
use tokio::io::AsyncWriteExt;

use crate::edge::limits::{check_head, malformed_head_error, read_head};
use crate::frontend::request_body::read_body;
use crate::openai::headers::EngineTarget;
use crate::openai::headers::{ProxyHeaders, content_length, downstream_response, upstream_request};

/// Feeds `bytes` to a server session as one client connection, then closes the
/// client side, and runs the head reader and the body reader on it.
fn serve(bytes: Vec<u8>, limit: u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let writer = tokio::spawn(async move {
            let _ = client.write_all(&bytes).await;
            let _ = client.shutdown().await;
            // Keep the client half open a little so the reader sees the data first.
            tokio::time::sleep(Duration::from_millis(1)).await;
        });
        let mut session = ServerSession::new_http1(Box::new(server));
        let shutdown = tokio::sync::watch::channel(false).1;
        match read_head(&mut session, Duration::from_millis(200), &shutdown, true).await {
            crate::edge::limits::HeadRead::Ready => {
                let _ = check_head(session.req_header(), &LimitsConfig::default());
                let declared = content_length(session.req_header());
                let deadline = tokio::time::Instant::now() + Duration::from_millis(200);
                let _ = read_body(&mut session, limit, declared, deadline).await;
            }
            crate::edge::limits::HeadRead::Malformed(error) => {
                let _ = malformed_head_error(&error);
            }
            crate::edge::limits::HeadRead::Closed | crate::edge::limits::HeadRead::TimedOut => {}
        }
        let _ = writer.await;
    });
}

/// A request head with a body framing the fuzzer chooses.
fn request(framing: u8, body: &[u8]) -> Vec<u8> {
    let mut out = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n".to_vec();
    match framing % 3 {
        0 => out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes()),
        1 => out.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n"),
        _ => out.extend_from_slice(b"content-length: 5\r\n\r\n"),
    }
    out.extend_from_slice(body);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn any_bytes_as_a_request_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        serve(bytes, 64);
    }

    #[test]
    fn any_body_under_any_framing_never_panics(
        framing in any::<u8>(),
        body in proptest::collection::vec(any::<u8>(), 0..1024),
        limit in 1u64..2048,
    ) {
        serve(request(framing, &body), limit);
    }

    #[test]
    fn chunked_bodies_with_odd_sizes_never_panic(
        chunks in proptest::collection::vec(("[0-9a-fA-FxX;= -]{0,12}", proptest::collection::vec(any::<u8>(), 0..64)), 0..8),
    ) {
        let mut body = Vec::new();
        for (size, data) in chunks {
            body.extend_from_slice(size.as_bytes());
            body.extend_from_slice(b"\r\n");
            body.extend_from_slice(&data);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(b"0\r\n\r\n");
        serve(request(1, &body), 256);
    }

    #[test]
    fn any_header_fields_pass_the_header_code(
        fields in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 1..24), proptest::collection::vec(any::<u8>(), 0..48)), 0..24),
        status in 100u16..600,
    ) {
        let mut request = RequestHeader::build("POST", b"/v1/completions", None).unwrap();
        let mut response = ResponseHeader::build(status, None).unwrap();
        for (name, value) in &fields {
            let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) else {
                continue;
            };
            let _ = request.append_header(name.clone(), value.clone());
            let _ = response.append_header(name, value);
        }
        let limits = LimitsConfig { max_headers: 8, max_header_bytes: 256, ..LimitsConfig::default() };
        let _ = check_head(&request, &limits);
        let _ = content_length(&request);
        let host = HeaderValue::from_static("127.0.0.1:1");
        let id = HeaderValue::from_static("rid");
        let target = EngineTarget { host: &host, body_len: Some(3), request_id: &id, trace: None, dp_rank: None };
        let _ = upstream_request(&request, &target);
        let ours = ProxyHeaders { instance: &host, request_id: &id, route: None };
        for (version, h2) in [(Version::HTTP_11, false), (Version::HTTP_10, false), (Version::HTTP_2, true)] {
            let _ = downstream_response(&response, ours, version, h2);
        }
    }
}

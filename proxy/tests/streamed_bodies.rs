//! Multipart uploads to an engine route stream through: the engine receives the body while
//! the client is still sending it, over every client protocol (HTTP/1.1 by length or
//! chunked on the fast path, h2c on pingora's) and both engine clients (our HTTP/1.1 one,
//! pingora's h2c). A streamed body is tried again elsewhere only while the client has sent
//! nothing beyond the start the proxy holds; the size limit holds while it streams.

#[allow(dead_code)]
mod support;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::{TestBody, TestProxy, channel_body, closed_port, full, model_yaml, send};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

const PATH: &str = "/v1/audio/transcriptions";
const BOUNDARY: &str = "kvmeshXboundary";

/// The start of a multipart form naming model `m`, up to its file's first byte.
fn form_start() -> Vec<u8> {
    format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n\
         --{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
         Content-Type: audio/wav\r\n\r\n"
    )
    .into_bytes()
}

/// The end of the form, after the file.
fn form_end() -> Vec<u8> {
    format!("\r\n--{BOUNDARY}--\r\n").into_bytes()
}

/// `len` bytes of file content that differ along the way (a shifted byte shows).
fn file_bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32 * 31 + u32::from(seed)) as u8)
        .collect()
}

/// How an [`Uploads`] engine answers once a body is read.
#[derive(Clone, Copy)]
enum Answer {
    /// 200 with the byte count.
    Ok,
    /// This status, after reading the whole body.
    Status(u16),
    /// Drops the connection once this many body bytes arrived.
    BreakAfter(u64),
}

/// An engine (HTTP/1.1 and h2c) that counts a request's body bytes as they arrive.
struct Uploads {
    url: String,
    /// Requests whose head arrived.
    heads: Arc<AtomicUsize>,
    /// Body bytes received so far, over all requests.
    received: watch::Receiver<u64>,
    /// Each whole body read (a body cut short: its error).
    bodies: Arc<Mutex<Vec<Result<Bytes, String>>>>,
    task: JoinHandle<()>,
}

impl Drop for Uploads {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Uploads {
    async fn start(answer: Answer) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let heads = Arc::new(AtomicUsize::new(0));
        let (counter, received) = watch::channel(0u64);
        let counter = Arc::new(counter);
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let (seen, kept) = (Arc::clone(&heads), Arc::clone(&bodies));
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (heads, counter, bodies) =
                    (Arc::clone(&seen), Arc::clone(&counter), Arc::clone(&kept));
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<Incoming>| {
                        let (heads, counter, bodies) = (
                            Arc::clone(&heads),
                            Arc::clone(&counter),
                            Arc::clone(&bodies),
                        );
                        async move {
                            heads.fetch_add(1, Ordering::SeqCst);
                            let mut body = request.into_body();
                            let mut read = Vec::new();
                            let outcome = loop {
                                match body.frame().await {
                                    None => break Ok(()),
                                    Some(Err(error)) => break Err(error.to_string()),
                                    Some(Ok(frame)) => {
                                        let Ok(data) = frame.into_data() else {
                                            continue;
                                        };
                                        read.extend_from_slice(&data);
                                        counter.send_modify(|n| *n += data.len() as u64);
                                        if let Answer::BreakAfter(limit) = answer
                                            && read.len() as u64 >= limit
                                        {
                                            bodies.lock().unwrap().push(Err("broken".into()));
                                            return Err(io::Error::other("engine broke off"));
                                        }
                                    }
                                }
                            };
                            let length = read.len();
                            bodies
                                .lock()
                                .unwrap()
                                .push(outcome.map(|()| Bytes::from(read)));
                            let status = match answer {
                                Answer::Status(status) => status,
                                _ => 200,
                            };
                            let reply = Response::builder()
                                .status(status)
                                .header("content-type", "application/json")
                                .body(full(format!("{{\"bytes\":{length}}}")))
                                .unwrap();
                            Ok::<Response<TestBody>, io::Error>(reply)
                        }
                    });
                    let builder =
                        hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let _ = builder.serve_connection(TokioIo::new(tcp), service).await;
                });
            }
        });
        Self {
            url,
            heads,
            received,
            bodies,
            task,
        }
    }

    /// Waits (5 s at most) until at least `bytes` body bytes have arrived.
    async fn received_at_least(&mut self, bytes: u64) {
        let wait = self.received.wait_for(|received| *received >= bytes);
        if tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .is_err()
        {
            panic!(
                "the engine has {} of {bytes} body bytes the client sent: the body is held back",
                *self.received.borrow()
            );
        }
    }

    fn heads(&self) -> usize {
        self.heads.load(Ordering::SeqCst)
    }

    fn bodies(&self) -> Vec<Result<Bytes, String>> {
        self.bodies.lock().unwrap().clone()
    }
}

/// How the test client sends its upload.
#[derive(Clone, Copy, Debug)]
enum Client {
    /// HTTP/1.1 with `Content-Length` (the fast path).
    Length,
    /// HTTP/1.1 chunked (the fast path).
    Chunked,
    /// h2c with prior knowledge (pingora's front end).
    H2c,
}

/// An upload in progress: feed it pieces, then drop `pieces` and await `reply`.
struct Upload {
    pieces: mpsc::Sender<io::Result<Bytes>>,
    reply: JoinHandle<Result<(StatusCode, Bytes), String>>,
    /// The answer's `Connection` field.
    connection: Arc<Mutex<Option<String>>>,
}

/// Starts an upload of `length` bytes (announced when the client sends a length) to the
/// proxy at `addr`.
async fn start_upload(addr: std::net::SocketAddr, client: Client, length: usize) -> Upload {
    let (pieces, body) = channel_body();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let uri = match client {
        Client::H2c => format!("http://{addr}{PATH}"),
        Client::Length | Client::Chunked => PATH.to_string(),
    };
    let mut request = Request::builder().method(Method::POST).uri(uri).header(
        "content-type",
        format!("multipart/form-data; boundary={BOUNDARY}"),
    );
    if !matches!(client, Client::H2c) {
        request = request.header("host", addr.to_string());
    }
    if matches!(client, Client::Length) {
        request = request.header("content-length", length);
    }
    let request = request.body(body).unwrap();
    let connection = Arc::new(Mutex::new(None));
    let field = Arc::clone(&connection);
    let read_reply = move |response: Response<Incoming>| async move {
        let value = response.headers().get("connection");
        *field.lock().unwrap() = value.map(|v| v.to_str().unwrap().to_string());
        let status = response.status();
        let body = response.into_body().collect().await;
        Ok((status, body.map_err(|e| e.to_string())?.to_bytes()))
    };
    let response: Pin<Box<dyn Future<Output = hyper::Result<Response<Incoming>>> + Send>> =
        match client {
            Client::Length | Client::Chunked => {
                let io = TokioIo::new(tcp);
                let (mut sender, connection) =
                    hyper::client::conn::http1::handshake(io).await.unwrap();
                tokio::spawn(connection);
                Box::pin(async move { sender.send_request(request).await })
            }
            Client::H2c => {
                let io = TokioIo::new(tcp);
                let (mut sender, connection) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                        .await
                        .unwrap();
                tokio::spawn(connection);
                Box::pin(async move { sender.send_request(request).await })
            }
        };
    let reply =
        tokio::spawn(async move { read_reply(response.await.map_err(|e| e.to_string())?).await });
    Upload {
        pieces,
        reply,
        connection,
    }
}

impl Upload {
    async fn send(&self, bytes: &[u8]) {
        self.pieces
            .send(Ok(Bytes::copy_from_slice(bytes)))
            .await
            .unwrap();
    }

    /// Sends `pieces` in turn until the proxy stops reading the body (it answered early).
    async fn offer<'p>(&self, pieces: impl IntoIterator<Item = &'p [u8]>) {
        for piece in pieces {
            let piece = Bytes::copy_from_slice(piece);
            if self.pieces.send(Ok(piece)).await.is_err() {
                return;
            }
        }
    }

    /// Ends the body and waits (10 s at most) for the answer.
    async fn finish(self) -> Result<(StatusCode, Bytes), String> {
        drop(self.pieces);
        tokio::time::timeout(Duration::from_secs(10), self.reply)
            .await
            .expect("an answer in time")
            .unwrap()
    }
}

async fn proxy_for(urls: &[&str], engine_protocol: &str, extra: &str) -> TestProxy {
    let yaml = format!(
        "{}health_check:\n  enabled: false\n{extra}",
        model_yaml("m", urls, engine_protocol)
    );
    TestProxy::start(&yaml).await
}

/// The form of an upload with `file`, in the pieces it is sent in: the first 100 KiB
/// (past the window the proxy reads before routing), then 256 KiB at a time.
fn form_pieces(file: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut form = form_start();
    form.extend_from_slice(file);
    form.extend_from_slice(&form_end());
    let pieces = form.chunks(256 * 1024).map(<[u8]>::to_vec).collect();
    (form, pieces)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_reaches_the_engine_while_the_client_still_sends_it() {
    let file = file_bytes(7, 3 * 1024 * 1024);
    let (form, _) = form_pieces(&file);
    let first = 100 * 1024;
    for (engine_protocol, label) in [
        ("", "HTTP/1.1 engine"),
        ("        protocol: h2c\n", "h2c engine"),
    ] {
        for client in [Client::Length, Client::Chunked, Client::H2c] {
            let mut engine = Uploads::start(Answer::Ok).await;
            let proxy = proxy_for(&[&engine.url], engine_protocol, "").await;
            let upload = start_upload(proxy.main, client, form.len()).await;
            upload.send(&form[..first]).await;
            // Nothing more is sent until the engine holds all the client sent so far.
            engine.received_at_least(first as u64).await;
            for piece in form[first..].chunks(256 * 1024) {
                upload.send(piece).await;
            }
            let (status, answer) = upload.finish().await.unwrap();
            assert_eq!(status, 200, "{client:?}, {label}");
            assert_eq!(answer, format!("{{\"bytes\":{}}}", form.len()));
            let bodies = engine.bodies();
            assert_eq!(bodies.len(), 1, "{client:?}, {label}");
            assert!(
                bodies[0].as_ref().unwrap() == &form[..],
                "{client:?}, {label}: the body arrives as it was sent"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_form_is_read_whole_and_a_large_one_over_the_limit_is_413_midway() {
    let engine = Uploads::start(Answer::Ok).await;
    let limit = "limits:\n  max_body_bytes: 1048576\n";
    let proxy = proxy_for(&[&engine.url], "", limit).await;
    // A form within the window: one request, read whole.
    let (small, _) = form_pieces(&file_bytes(1, 1000));
    let reply = send(
        proxy.main,
        Method::POST,
        PATH,
        &[(
            "content-type",
            &format!("multipart/form-data; boundary={BOUNDARY}"),
        )],
        small.clone(),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(engine.bodies(), vec![Ok(Bytes::from(small))]);
    // A chunked form that goes past the limit while it streams: 413 to the client, and
    // the engine's request is cut off (it never gets a whole body).
    let (large, _) = form_pieces(&file_bytes(2, 2 * 1024 * 1024));
    for client in [Client::Chunked, Client::H2c] {
        let upload = start_upload(proxy.main, client, large.len()).await;
        upload.offer(large.chunks(128 * 1024)).await;
        let finished = upload.finish().await;
        if let Ok((status, body)) = &finished {
            assert_eq!(
                *status,
                413,
                "{client:?}: {}",
                String::from_utf8_lossy(body)
            );
            let error: serde_json::Value = serde_json::from_slice(body).unwrap();
            assert_eq!(error["error"]["code"], "request_too_large", "{error}");
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while engine.bodies().len() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            engine.bodies().len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let bodies = engine.bodies();
    assert_eq!(bodies.len(), 3);
    for cut in &bodies[1..] {
        assert!(cut.is_err(), "the engine got no whole body past the limit");
    }
    let metrics = send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new())
        .await
        .text()
        .await
        .unwrap();
    let too_large = metrics
        .lines()
        .find(|line| {
            line.starts_with("kvmesh_client_errors_total") && line.contains("body_too_large")
        })
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(too_large.ends_with(" 2"), "{too_large}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_fails_over_before_its_rest_is_sent() {
    let engine = Uploads::start(Answer::Ok).await;
    let closed = closed_port();
    let dead = format!("http://{}", closed.addr);
    let proxy = proxy_for(&[&dead, &engine.url], "", "").await;
    let (form, pieces) = form_pieces(&file_bytes(3, 512 * 1024));
    // Round robin offers the refused port to one of the first two uploads at least.
    for i in 0..2 {
        let upload = start_upload(proxy.main, Client::Length, form.len()).await;
        for piece in &pieces {
            upload.send(piece).await;
        }
        let (status, answer) = upload.finish().await.unwrap();
        assert_eq!(
            status,
            200,
            "upload {i}: {}",
            String::from_utf8_lossy(&answer)
        );
    }
    assert_eq!(engine.bodies(), vec![Ok(Bytes::from(form.clone())); 2]);
    let metrics = send(proxy.admin, Method::GET, "/metrics", &[], Bytes::new())
        .await
        .text()
        .await
        .unwrap();
    let value = |series: &str| -> u64 {
        let line = metrics.lines().find(|line| line.starts_with(series));
        let line = line.unwrap_or_else(|| panic!("no {series} in {metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let refused = value(&format!(
        "kvmesh_upstream_errors_total{{instance=\"{dead}\",kind=\"connect\",model=\"m\"}}"
    ));
    assert!(refused >= 1, "{metrics}");
    let retried = value("kvmesh_retries_total{model=\"m\",reason=\"connect\"}");
    assert_eq!(retried, refused, "each refused attempt was tried again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_answered_before_its_rest_was_read_closes_the_connection() {
    // The only engine refuses: 502 once the start is read, the rest never read. What
    // follows on the connection is the rest of the body, not a request.
    let closed = closed_port();
    let dead = format!("http://{}", closed.addr);
    let proxy = proxy_for(&[&dead], "", "").await;
    let (form, pieces) = form_pieces(&file_bytes(8, 512 * 1024));
    let upload = start_upload(proxy.main, Client::Length, form.len()).await;
    let connection = Arc::clone(&upload.connection);
    upload.offer(pieces.iter().map(Vec::as_slice)).await;
    let (status, body) = upload.finish().await.unwrap();
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    assert_eq!(connection.lock().unwrap().as_deref(), Some("close"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_its_rest_is_sent_a_streamed_body_is_not_tried_again() {
    let (form, pieces) = form_pieces(&file_bytes(4, 1024 * 1024));
    // Both engines break off 200 KiB into the body: past the start the proxy holds.
    let a = Uploads::start(Answer::BreakAfter(200 * 1024)).await;
    let b = Uploads::start(Answer::BreakAfter(200 * 1024)).await;
    let proxy = proxy_for(&[&a.url, &b.url], "", "").await;
    let upload = start_upload(proxy.main, Client::Length, form.len()).await;
    upload.offer(pieces.iter().map(Vec::as_slice)).await;
    match upload.finish().await {
        Ok((status, body)) => {
            assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
            let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(error["error"]["code"], "upstream_unavailable", "{error}");
        }
        // The proxy may close while the client still writes the body it will not read.
        Err(error) => assert!(!error.is_empty()),
    }
    assert_eq!(a.heads() + b.heads(), 1, "one attempt only");

    // An engine's retryable status after the whole streamed body: relayed, not retried;
    // the same answer to a whole (small) body is retried on the other engine.
    let a = Uploads::start(Answer::Status(503)).await;
    let b = Uploads::start(Answer::Status(503)).await;
    let proxy = proxy_for(&[&a.url, &b.url], "", "").await;
    let upload = start_upload(proxy.main, Client::Chunked, form.len()).await;
    for piece in &pieces {
        upload.send(piece).await;
    }
    let (status, _) = upload.finish().await.unwrap();
    assert_eq!(status, 503);
    assert_eq!(
        a.heads() + b.heads(),
        1,
        "the streamed upload is not sent again"
    );
    let (small, _) = form_pieces(&file_bytes(5, 100));
    let form_type = format!("multipart/form-data; boundary={BOUNDARY}");
    let reply = send(
        proxy.main,
        Method::POST,
        PATH,
        &[("content-type", &form_type)],
        small,
    )
    .await;
    assert_eq!(reply.status, 503);
    assert_eq!(
        a.heads() + b.heads(),
        3,
        "a whole body is tried on the other engine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_h2c_engine_gets_the_upload_as_h2() {
    // pingora's client speaks h2 to an h2c engine: the request reaches it as HTTP/2, with
    // no connection-specific fields.
    let seen = Arc::new(Mutex::new(None));
    let kept = Arc::clone(&seen);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let kept = Arc::clone(&kept);
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let kept = Arc::clone(&kept);
                    async move {
                        let version = request.version();
                        let encoding = request.headers().get("transfer-encoding").cloned();
                        let length = request.headers().get("content-length").cloned();
                        let body = request.into_body().collect().await.unwrap().to_bytes();
                        *kept.lock().unwrap() = Some((version, encoding, length, body.len()));
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"{}"))))
                    }
                });
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let _ = builder.serve_connection(TokioIo::new(tcp), service).await;
            });
        }
    });
    let proxy = proxy_for(&[&url], "        protocol: h2c\n", "").await;
    let (form, pieces) = form_pieces(&file_bytes(6, 300 * 1024));
    let upload = start_upload(proxy.main, Client::Chunked, form.len()).await;
    for piece in &pieces {
        upload.send(piece).await;
    }
    let (status, body) = upload.finish().await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (version, encoding, length, bytes) = seen.lock().unwrap().take().unwrap();
    assert_eq!(version, Version::HTTP_2);
    assert_eq!(encoding, None);
    assert_eq!(length, None, "a chunked upload's length is not known");
    assert_eq!(bytes, form.len());
    task.abort();
}

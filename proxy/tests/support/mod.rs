//! Test harness: tiny hyper backends, the proxy started through the library
//! on port 0, and a raw hyper client.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvmesh_config::Config;
use kvmesh_proxy::{Proxy, ProxyError};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// A response body the backend can build.
pub type TestBody = BoxBody<Bytes, io::Error>;

/// A fixed body.
pub fn full(bytes: impl Into<Bytes>) -> TestBody {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// A body fed through a channel: send `Ok(bytes)` chunks, `Err` to abort the
/// connection mid-body, drop the sender to end it.
pub fn channel_body() -> (mpsc::Sender<io::Result<Bytes>>, TestBody) {
    let (tx, rx) = mpsc::channel(16);
    (tx, ChannelBody { rx }.boxed())
}

struct ChannelBody {
    rx: mpsc::Receiver<io::Result<Bytes>>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        self.rx
            .poll_recv(cx)
            .map(|item| item.map(|result| result.map(Frame::data)))
    }
}

/// A backend whose first response (health probes aside) streams a body fed through the returned sender (drop it
/// to end that response), with `content-type: content_type` when given; every later request
/// gets `{}` at once.
pub async fn held_first(
    content_type: Option<&'static str>,
) -> (mpsc::Sender<io::Result<Bytes>>, Backend) {
    let (tx, body) = channel_body();
    let body = Mutex::new(Some(body));
    let backend = Backend::start(move |request| {
        // Health probes reach the handler too: they never take the held body.
        let body = (request.path != "/health")
            .then(|| body.lock().unwrap().take())
            .flatten();
        async move {
            match (body, content_type) {
                (Some(body), Some(kind)) => Response::builder()
                    .header("content-type", kind)
                    .body(body)
                    .unwrap(),
                (Some(body), None) => Response::new(body),
                (None, _) => Response::new(full("{}")),
            }
        }
    })
    .await;
    (tx, backend)
}

/// What a backend received.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: Method,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub version: http::Version,
}

type Handler =
    Arc<dyn Fn(Recorded) -> Pin<Box<dyn Future<Output = Response<TestBody>> + Send>> + Send + Sync>;

/// A hyper server (HTTP/1.1 and h2c) on a free loopback port.
pub struct Backend {
    pub addr: SocketAddr,
    pub url: String,
    requests: Arc<Mutex<Vec<Recorded>>>,
    connections: Arc<std::sync::atomic::AtomicUsize>,
    task: JoinHandle<()>,
}

impl Backend {
    /// Starts a backend answering every request with `handler`.
    pub async fn start<F, Fut>(handler: F) -> Self
    where
        F: Fn(Recorded) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<TestBody>> + Send + 'static,
    {
        let handler: Handler = Arc::new(move |recorded| Box::pin(handler(recorded)));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let recorded = Arc::clone(&requests);
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let accepted = Arc::clone(&connections);
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let handler = Arc::clone(&handler);
                let recorded = Arc::clone(&recorded);
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<Incoming>| {
                        let handler = Arc::clone(&handler);
                        let recorded = Arc::clone(&recorded);
                        async move {
                            let (parts, body) = request.into_parts();
                            let body = body
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let request = Recorded {
                                method: parts.method,
                                path: parts
                                    .uri
                                    .path_and_query()
                                    .map(|p| p.to_string())
                                    .unwrap_or_default(),
                                headers: parts.headers,
                                body,
                                version: parts.version,
                            };
                            // The proxy's own probes (health checks, the tokenizer
                            // check) are not requests it forwards.
                            let probe = request.path == "/health"
                                || request.headers.get("user-agent").is_some_and(|agent| {
                                    agent.as_bytes() == b"kvmesh-tokenizer-check"
                                });
                            if !probe {
                                recorded.lock().unwrap().push(request.clone());
                            }
                            Ok::<_, Infallible>(handler(request).await)
                        }
                    });
                    let builder =
                        hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    let _ = builder.serve_connection(TokioIo::new(tcp), service).await;
                });
            }
        });
        Self {
            addr,
            url: format!("http://{addr}"),
            requests,
            connections,
            task,
        }
    }

    /// A backend answering `200 {"ok":true}` (and `/health`).
    pub async fn ok() -> Self {
        Self::start(|_| async {
            Response::builder()
                .header("content-type", "application/json")
                .body(full(r#"{"ok":true}"#))
                .unwrap()
        })
        .await
    }

    /// TCP connections accepted so far (probes included).
    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Requests received so far (the proxy's health and tokenizer probes excluded).
    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    /// Each request received so far as `METHOD path request-id`, for assertion messages.
    pub fn seen(&self) -> Vec<String> {
        self.requests()
            .iter()
            .map(|r| {
                let id = r.headers.get("x-request-id").and_then(|v| v.to_str().ok());
                format!("{} {} {}", r.method, r.path, id.unwrap_or("-"))
            })
            .collect()
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A loopback port held by a socket that is bound but never listens: connecting to it is
/// refused for as long as the value lives. (A port only found free and let go can be taken
/// by another test's backend, which then receives this test's requests: a CI run once
/// counted 13 requests at a backend sent 10.)
pub struct ClosedPort {
    /// The refused address.
    pub addr: SocketAddr,
    _socket: tokio::net::TcpSocket,
}

/// A loopback address nothing listens on, reserved while the [`ClosedPort`] lives.
pub fn closed_port() -> ClosedPort {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    ClosedPort {
        addr,
        _socket: socket,
    }
}

/// The proxy, started through the library.
pub struct TestProxy {
    pub main: SocketAddr,
    pub admin: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ProxyError>>,
}

impl TestProxy {
    /// Starts a proxy from YAML `models:` etc.; listeners are on port 0.
    pub async fn start(yaml: &str) -> Self {
        let text = format!(
            "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n{yaml}"
        );
        let config = Config::from_yaml_str(&text, "test.yaml").unwrap();
        let proxy = Proxy::bind(config).await.unwrap();
        let main = proxy.listeners()[0].address;
        let admin = proxy.admin_address();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(proxy.run(async move {
            let _ = rx.await;
        }));
        Self {
            main,
            admin,
            shutdown: Some(tx),
            task,
        }
    }

    /// Begins graceful shutdown.
    pub fn begin_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Waits for `run` to return.
    pub async fn stopped(self) -> Result<(), ProxyError> {
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("proxy stops")
            .expect("proxy task")
    }
}

/// A response with its body not yet read.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Incoming,
}

impl Reply {
    /// The header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The next data frame (`None` at the end).
    pub async fn next_chunk(&mut self) -> Option<Result<Bytes, hyper::Error>> {
        loop {
            match self.body.frame().await? {
                Ok(frame) => match frame.into_data() {
                    Ok(data) => return Some(Ok(data)),
                    Err(_) => continue,
                },
                Err(error) => return Some(Err(error)),
            }
        }
    }

    /// The whole body.
    pub async fn text(self) -> Result<String, hyper::Error> {
        let bytes = self.body.collect().await?.to_bytes();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The whole body as JSON.
    pub async fn json(self) -> serde_json::Value {
        let text = self.text().await.unwrap();
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    }
}

/// Sends one request on a fresh HTTP/1.1 connection.
pub async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(connection);
    let mut request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Full::new(body.into())).unwrap();
    let response = sender.send_request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// Sends one request over h2c (prior knowledge).
pub async fn send_h2c(addr: SocketAddr, path: &str, body: impl Into<Bytes>) -> Reply {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(connection);
    let request = Request::builder()
        .method(Method::POST)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// POSTs a JSON body to `/v1/chat/completions`.
pub async fn chat(addr: SocketAddr, body: &str) -> Reply {
    send(
        addr,
        Method::POST,
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body.to_string(),
    )
    .await
}

/// A models section with one model over `urls`.
pub fn model_yaml(name: &str, urls: &[&str], extra_backend: &str) -> String {
    let mut yaml = format!("models:\n  - name: {name}\n    backends:\n");
    for url in urls {
        yaml.push_str(&format!("      - url: {url}\n{extra_backend}"));
    }
    yaml
}

/// Polls `GET admin/health` until it answers `status`.
pub async fn await_health(admin: SocketAddr, status: u16) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let reply = send(admin, Method::GET, "/health", &[], Bytes::new()).await;
        if reply.status.as_u16() == status {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "health never answered {status}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Checks the OpenAI error shape and returns the `error` object.
pub async fn error_of(reply: Reply) -> serde_json::Value {
    let json = reply.json().await;
    let error = json["error"].clone();
    for field in ["message", "type", "param", "code"] {
        assert!(error.get(field).is_some(), "no {field} in {json}");
    }
    error
}

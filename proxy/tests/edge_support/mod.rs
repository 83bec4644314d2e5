//! Helpers of the edge tests: the proxy started through the library from a
//! config (YAML text or a file) with its reload handle, a TLS client (rustls,
//! HTTP/1.1 or h2 by ALPN), a TLS backend, and metric scraping.

#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvmesh_config::Config;
use kvmesh_proxy::{Proxy, ProxyError, ReloadHandle};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The proxy, started through the library.
pub struct EdgeProxy {
    /// The first data listener.
    pub main: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
    /// Reloads its config.
    pub reload: ReloadHandle,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ProxyError>>,
}

impl EdgeProxy {
    /// Starts a proxy from YAML text (it names its own listeners, on port 0).
    pub async fn from_yaml(yaml: &str) -> Self {
        let config = Config::from_yaml_str(yaml, "edge.yaml").unwrap();
        Self::serve(Proxy::bind(config).await.unwrap())
    }

    /// Starts a proxy from the config file at `path` (reloads re-read it).
    pub async fn from_file(path: &Path) -> Self {
        let config = Config::load(path).unwrap();
        Self::serve(Proxy::bind_file(config, path).await.unwrap())
    }

    fn serve(proxy: Proxy) -> Self {
        let main = proxy.listeners()[0].address;
        let admin = proxy.admin_address();
        let reload = proxy.reload_handle();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(proxy.run(async move {
            let _ = rx.await;
        }));
        Self {
            main,
            admin,
            reload,
            shutdown: Some(tx),
            task,
        }
    }

    /// Shuts down and waits for `run` to return.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("proxy stops")
            .expect("proxy task")
            .expect("proxy run");
    }

    /// The value of the metric series `series` (e.g. `name{label="x"}`), 0 when absent.
    pub async fn metric(&self, series: &str) -> f64 {
        metric(self.admin, series).await
    }
}

/// Reads one series from `GET admin/metrics` (0 when absent).
pub async fn metric(admin: SocketAddr, series: &str) -> f64 {
    let reply = plain(admin, Method::GET, "/metrics", &[], Bytes::new()).await;
    let text = String::from_utf8_lossy(&reply.body).into_owned();
    text.lines()
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
        .unwrap_or(0.0)
}

/// [`metric`] once it reads `expected`, or its last reading after 5 s: a request's counters
/// are recorded when it finishes, which may come just after its client read the whole reply.
pub async fn metric_reaching(admin: SocketAddr, series: &str, expected: f64) -> f64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let value = metric(admin, series).await;
        if value == expected || tokio::time::Instant::now() >= deadline {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A whole response.
#[derive(Debug)]
pub struct Reply {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body.
    pub body: Bytes,
    /// The protocol ALPN chose (TLS only).
    pub alpn: Option<Vec<u8>>,
    /// The server's leaf certificate (TLS only).
    pub server_cert: Option<Vec<u8>>,
    /// The HTTP version of the response.
    pub version: http::Version,
}

impl Reply {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    /// A header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// One request on a fresh plaintext HTTP/1.1 connection.
pub async fn plain(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Reply {
    let tcp = TcpStream::connect(addr).await.unwrap();
    send_http1(TokioIo::new(tcp), addr, method, path, headers, body)
        .await
        .unwrap()
}

async fn send_http1<T>(
    io: T,
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Result<Reply, String>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let request = build(&format!("http://{addr}{path}"), method, headers, body, true);
    collect(
        sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?,
    )
    .await
}

fn build(
    uri: &str,
    method: Method,
    headers: &[(&str, &str)],
    body: Bytes,
    host: bool,
) -> Request<Full<Bytes>> {
    let mut request = Request::builder().method(method).uri(uri);
    if host && let Some(authority) = uri.split('/').nth(2) {
        request = request.header("host", authority);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(Full::new(body)).unwrap()
}

async fn collect(response: Response<Incoming>) -> Result<Reply, String> {
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body,
        alpn: None,
        server_cert: None,
        version: parts.version,
    })
}

/// Reads the first PEM certificate chain of `file`.
fn certificates(file: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(file)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// A rustls client trusting the CAs in `ca`, optionally with a client certificate.
#[derive(Clone)]
pub struct TlsClient {
    connector: TlsConnector,
}

impl TlsClient {
    /// A client trusting `ca`, presenting `identity` (certificate, key) when given.
    pub fn new(ca: &Path, identity: Option<(&Path, &Path)>) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        for certificate in certificates(ca) {
            roots.add(certificate).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let mut config = match identity {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    certificates(cert),
                    PrivateKeyDer::from_pem_file(key).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Self {
            connector: TlsConnector::from(Arc::new(config)),
        }
    }

    /// A client that offers only `http/1.1` by ALPN.
    pub fn http1_only(ca: &Path) -> Self {
        let client = Self::new(ca, None);
        let mut config = (*client.connector.config().clone()).clone();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Self {
            connector: TlsConnector::from(Arc::new(config)),
        }
    }

    /// A fresh TLS connection to `addr` (server name `localhost`), for raw bytes.
    pub async fn connect(&self, addr: SocketAddr) -> tokio_rustls::client::TlsStream<TcpStream> {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        self.connector.connect(name, tcp).await.unwrap()
    }

    /// One request on a fresh TLS connection to `addr` (server name `localhost`);
    /// HTTP/2 or HTTP/1.1 as ALPN chooses.
    pub async fn request(
        &self,
        addr: SocketAddr,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Reply, String> {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
        let tls = self
            .connector
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        let (_, connection) = tls.get_ref();
        let alpn = connection.alpn_protocol().map(<[u8]>::to_vec);
        let server_cert = connection
            .peer_certificates()
            .and_then(|chain| chain.first())
            .map(|cert| cert.to_vec());
        let mut reply = if alpn.as_deref() == Some(b"h2") {
            let (mut sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                    .await
                    .map_err(|e| e.to_string())?;
            tokio::spawn(connection);
            let uri = format!("https://localhost:{}{path}", addr.port());
            let request = build(&uri, method, headers, body, false);
            collect(
                sender
                    .send_request(request)
                    .await
                    .map_err(|e| e.to_string())?,
            )
            .await?
        } else {
            send_http1(TokioIo::new(tls), addr, method, path, headers, body).await?
        };
        reply.alpn = alpn;
        reply.server_cert = server_cert;
        Ok(reply)
    }

    /// An open HTTP/2 connection, for requests over time.
    pub async fn h2_connection(
        &self,
        addr: SocketAddr,
    ) -> Result<hyper::client::conn::http2::SendRequest<Full<Bytes>>, String> {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
        let tls = self
            .connector
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        let (sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        Ok(sender)
    }
}

/// Sends a request on an open h2 connection.
pub async fn h2_send(
    sender: &mut hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    port: u16,
    path: &str,
    body: Bytes,
) -> Result<Reply, String> {
    let uri = format!("https://localhost:{port}{path}");
    let request = build(
        &uri,
        Method::POST,
        &[("content-type", "application/json")],
        body,
        false,
    );
    collect(
        sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?,
    )
    .await
}

/// An engine stand-in answering `{"ok":true,"backend":NAME}` to everything, with
/// its `/health` probes counted; plaintext, or TLS with the given certificate.
pub struct CountingBackend {
    /// Its address.
    pub addr: SocketAddr,
    /// Health probes received.
    pub probes: Arc<AtomicUsize>,
    /// Other requests received.
    pub requests: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl CountingBackend {
    /// A plaintext backend named `name`.
    pub async fn start(name: &'static str) -> Self {
        Self::start_with(name, None).await
    }

    /// A backend named `name`, over TLS with `identity` (certificate, key) when given.
    pub async fn start_with(name: &'static str, identity: Option<(&Path, &Path)>) -> Self {
        let acceptor = identity.map(|(cert, key)| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(
                    certificates(cert),
                    PrivateKeyDer::from_pem_file(key).unwrap(),
                )
                .unwrap();
            TlsAcceptor::from(Arc::new(config))
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let probes = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let (probe_count, request_count) = (Arc::clone(&probes), Arc::clone(&requests));
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (probes, requests) = (Arc::clone(&probe_count), Arc::clone(&request_count));
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request: Request<Incoming>| {
                        let counter = if request.uri().path() == "/health" {
                            &probes
                        } else {
                            &requests
                        };
                        counter.fetch_add(1, Ordering::Relaxed);
                        async move {
                            let _ = request.into_body().collect().await;
                            let body = format!(r#"{{"ok":true,"backend":"{name}"}}"#);
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .header("content-type", "application/json")
                                    .body(Full::new(Bytes::from(body)))
                                    .unwrap(),
                            )
                        }
                    });
                    let builder =
                        hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    match acceptor {
                        Some(acceptor) => {
                            if let Ok(tls) = acceptor.accept(tcp).await {
                                let _ = builder.serve_connection(TokioIo::new(tls), service).await;
                            }
                        }
                        None => {
                            let _ = builder.serve_connection(TokioIo::new(tcp), service).await;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            probes,
            requests,
            task,
        }
    }
}

impl Drop for CountingBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A chat body for `model`.
pub fn chat(model: &str) -> Bytes {
    Bytes::from(format!(
        r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#
    ))
}

//! Keep-alive connections to the target: one HTTP/1.1 connection per lane, or one shared
//! HTTP/2 (h2c, prior knowledge) connection multiplexing every lane.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

/// Request body type: the whole JSON body in one buffer.
pub type RequestBody = Full<Bytes>;

/// The sending half of a connection.
#[derive(Debug)]
pub enum Sender {
    /// An HTTP/1.1 connection (one request at a time).
    Http1(http1::SendRequest<RequestBody>),
    /// A handle on a multiplexed HTTP/2 connection.
    Http2(http2::SendRequest<RequestBody>),
}

impl Sender {
    /// Waits until the connection can take a request; fails if it is closed.
    pub async fn ready(&mut self) -> hyper::Result<()> {
        match self {
            Self::Http1(s) => s.ready().await,
            Self::Http2(s) => s.ready().await,
        }
    }

    /// Sends a request and waits for the response head.
    pub async fn send(
        &mut self,
        request: Request<RequestBody>,
    ) -> hyper::Result<Response<Incoming>> {
        match self {
            Self::Http1(s) => s.send_request(request).await,
            Self::Http2(s) => s.send_request(request).await,
        }
    }
}

/// Failure to open a connection.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The TCP connection failed.
    #[error("TCP connect failed: {0}")]
    Tcp(#[from] std::io::Error),
    /// The HTTP handshake failed.
    #[error("HTTP handshake failed: {0}")]
    Handshake(#[from] hyper::Error),
}

/// Opens connections to one address.
#[derive(Debug)]
pub struct Connector {
    addr: SocketAddr,
    /// More servers new HTTP/1.1 connections go to in turn with `addr` (replicas).
    replicas: Vec<SocketAddr>,
    next: AtomicUsize,
    http2: bool,
    shared_h2: Mutex<Option<http2::SendRequest<RequestBody>>>,
}

impl Connector {
    /// A connector for `addr`, speaking HTTP/2 (h2c) when `http2` is set.
    pub fn new(addr: SocketAddr, http2: bool) -> Self {
        Self {
            addr,
            replicas: Vec::new(),
            next: AtomicUsize::new(0),
            http2,
            shared_h2: Mutex::new(None),
        }
    }

    /// New connections go in turn to `addr` and each of `replicas` (servers sharing the
    /// load, such as proxy replicas).
    pub fn with_replicas(mut self, replicas: Vec<SocketAddr>) -> Self {
        self.replicas = replicas;
        self
    }

    /// Whether connections speak HTTP/2.
    pub fn is_http2(&self) -> bool {
        self.http2
    }

    /// A sender on a new HTTP/1.1 connection, or on the shared HTTP/2 connection (re-opened
    /// when it has closed).
    pub async fn connect(&self) -> Result<Sender, ConnectError> {
        if !self.http2 {
            let (sender, connection) = http1::handshake(self.tcp().await?).await?;
            tokio::spawn(connection);
            return Ok(Sender::Http1(sender));
        }
        let current = self
            .shared_h2
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(|s| !s.is_closed());
        if let Some(sender) = current {
            return Ok(Sender::Http2(sender));
        }
        let (sender, connection) =
            http2::handshake(TokioExecutor::new(), self.tcp().await?).await?;
        tokio::spawn(connection);
        *self
            .shared_h2
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(sender.clone());
        Ok(Sender::Http2(sender))
    }

    async fn tcp(&self) -> Result<TokioIo<TcpStream>, std::io::Error> {
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % (self.replicas.len() + 1);
        let addr = turn
            .checked_sub(1)
            .map_or(self.addr, |replica| self.replicas[replica]);
        let stream = TcpStream::connect(addr).await?;
        // Nagle would hold small writes back behind delayed ACKs.
        stream.set_nodelay(true)?;
        Ok(TokioIo::new(stream))
    }
}

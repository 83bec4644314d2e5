//! The connections of the tonic listeners (KServe gRPC and the endpoint picker): bound
//! ([`bind`]), accepted with TCP_NODELAY and, with TLS, through a listener's TLS terminator
//! (rotated with its files; ALPN h2), handshakes running concurrently, off the accept loop
//! ([`incoming`]); served until shutdown plus a drain bound ([`serve_draining`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use pingora_core::protocols::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::time::sleep;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::edge::error::ProxyError;
use crate::edge::tls::ListenerTls;

/// Pause after a failed `accept` (e.g. out of file descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);

/// Connections handed over but not yet taken by the server.
const BACKLOG: usize = 64;

/// One client connection.
pub(crate) enum Conn {
    /// Plaintext HTTP/2.
    Plain(TcpStream),
    /// TLS.
    Tls(Stream),
}

/// Binds the gRPC-speaking listener `name` (`grpc`, `epp`) at `address`; returns the socket
/// and its real address (the port picked when `address` said 0).
pub(crate) async fn bind(
    name: &str,
    address: SocketAddr,
) -> Result<(TcpListener, SocketAddr), ProxyError> {
    let bind_error = |source| ProxyError::Bind {
        name: name.to_string(),
        address,
        source,
    };
    let socket = TcpListener::bind(address).await.map_err(bind_error)?;
    let bound = socket.local_addr().map_err(bind_error)?;
    Ok((socket, bound))
}

/// Runs `server` until it ends, or until `drain_timeout` after `stopping` fires (then the
/// calls still open are closed); `what` names the listener in the log.
pub(crate) async fn serve_draining<E: std::fmt::Display>(
    server: impl Future<Output = Result<(), E>>,
    stopping: oneshot::Receiver<()>,
    drain_timeout: Duration,
    what: &str,
) -> Result<(), ProxyError> {
    tokio::pin!(server);
    let drained = async {
        let _ = stopping.await;
        tokio::time::sleep(drain_timeout).await;
    };
    tokio::select! {
        served = &mut server => served.map_err(|error| ProxyError::Grpc(error.to_string())),
        () = drained => {
            tracing::warn!(listener = what, "drain timeout reached; closing the remaining calls");
            Ok(())
        }
    }
}

/// Accepts on `listener` until the returned stream is dropped; with `tls`, each
/// connection first completes its handshake within `handshake_timeout`.
pub(crate) fn incoming(
    listener: TcpListener,
    tls: Option<Arc<ListenerTls>>,
    handshake_timeout: Duration,
) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(BACKLOG);
    tokio::spawn(accept_loop(listener, tls, handshake_timeout, tx));
    ReceiverStream::new(rx)
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<Arc<ListenerTls>>,
    handshake_timeout: Duration,
    tx: mpsc::Sender<io::Result<Conn>>,
) {
    loop {
        let accepted = tokio::select! {
            () = tx.closed() => return,
            accepted = listener.accept() => accepted,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(error) => {
                tracing::warn!(%error, "gRPC accept failed");
                sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "TCP_NODELAY failed on an accepted gRPC socket");
        }
        match &tls {
            None => {
                if tx.send(Ok(Conn::Plain(tcp))).await.is_err() {
                    return;
                }
            }
            Some(tls) => {
                let (tls, tx) = (Arc::clone(tls), tx.clone());
                tokio::spawn(async move {
                    if let Some(stream) = tls.accept(tcp, handshake_timeout).await {
                        let _ = tx.send(Ok(Conn::Tls(stream))).await;
                    }
                });
            }
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_read(cx, buf),
            Self::Tls(stream) => Pin::new(stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_write(cx, buf),
            Self::Tls(stream) => Pin::new(stream).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_write_vectored(cx, bufs),
            Self::Tls(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(tcp) => tcp.is_write_vectored(),
            Self::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_flush(cx),
            Self::Tls(stream) => Pin::new(stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_shutdown(cx),
            Self::Tls(stream) => Pin::new(stream).poll_shutdown(cx),
        }
    }
}

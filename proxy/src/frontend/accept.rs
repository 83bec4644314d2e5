//! The accept loop: our own tokio listener (so port 0 works and shutdown is
//! ours), TCP_NODELAY on every accepted socket, TLS termination or h2c
//! detection, the HTTP/1 fast path for the data connections' HTTP/1.1 (plaintext, or TLS
//! that chose it), and draining.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::BytesMut;
use pingora_core::apps::{HttpServerApp, ReusedHttpStream, ServerApp};
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::http::v1::server::HttpSession;
use pingora_core::protocols::l4::stream::Stream as L4Stream;
use pingora_core::protocols::{ALPN, Stream};
use pingora_core::server::ShutdownWatch;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep, timeout, timeout_at};

use crate::edge::tls::ListenerTls;
use crate::frontend::h1::server::{ConnectionEnd, serve as serve_fast};
use crate::state::shared::State;

/// The HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Pause after a failed `accept` (e.g. out of file descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);

/// Poll interval while a client has sent only part of the h2 preface.
const PREFACE_POLL: Duration = Duration::from_millis(1);

/// Longest wait for a TLS connection's close_notify to leave once the fast path is done.
const TLS_CLOSE_WAIT: Duration = Duration::from_secs(1);

/// Keep-alive timeout of HTTP/1 client connections, in seconds (pingora's default).
const H1_KEEPALIVE_SECS: u64 = 60;

/// What one listener serves.
pub(crate) struct ListenerApps<A> {
    /// App for HTTP/1.x connections.
    pub(crate) h1: Arc<A>,
    /// App for connections opening with the h2 preface (`None`: HTTP/1 only).
    pub(crate) h2c: Option<Arc<A>>,
    /// Serve HTTP/1 connections (plaintext, or TLS without h2) on our own fast path first,
    /// with this state (`None`: pingora serves them, through `h1`).
    pub(crate) fast: Option<Arc<ArcSwap<State>>>,
    /// Time a new connection has to send its first bytes.
    pub(crate) first_bytes_timeout: Duration,
    /// Longest wait for open connections once shutdown begins.
    pub(crate) drain_timeout: Duration,
    /// TLS termination (then HTTP/2 or HTTP/1.1 by ALPN, served by `h1`).
    pub(crate) tls: Option<Arc<ListenerTls>>,
}

/// Accepts until `shutdown` turns true, then waits for open connections up
/// to the drain timeout and drops (aborts) the rest.
pub(crate) async fn serve<A>(
    listener: TcpListener,
    apps: ListenerApps<A>,
    mut shutdown: ShutdownWatch,
) where
    A: HttpServerApp + Send + Sync + 'static,
{
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    break;
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    if let Err(error) = tcp.set_nodelay(true) {
                        tracing::debug!(%error, "TCP_NODELAY failed on an accepted socket");
                    }
                    connections.spawn(serve_connection(
                        tcp,
                        Arc::clone(&apps.h1),
                        apps.h2c.clone(),
                        apps.fast.clone(),
                        apps.tls.clone(),
                        apps.first_bytes_timeout,
                        shutdown.clone(),
                    ));
                }
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    sleep(ACCEPT_BACKOFF).await;
                }
            },
        }
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    let deadline = Instant::now() + apps.drain_timeout;
    let drained = timeout_at(deadline, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open = connections.len(),
            "drain timeout reached; closing the remaining connections"
        );
        connections.abort_all();
    }
}

/// Serves one connection: over TLS (HTTP/2 or HTTP/1.1 by ALPN), or in
/// plaintext HTTP/1 or, when it opens with the preface, h2c. HTTP/2 goes through
/// pingora's [`ServerApp::process_new`]; HTTP/1 through the fast path when the listener has
/// one, and the rest (or what the fast path hands over) through [`serve_h1`].
async fn serve_connection<A>(
    mut tcp: TcpStream,
    h1: Arc<A>,
    h2c: Option<Arc<A>>,
    fast: Option<Arc<ArcSwap<State>>>,
    tls: Option<Arc<ListenerTls>>,
    first_bytes_timeout: Duration,
    shutdown: ShutdownWatch,
) where
    A: HttpServerApp + Send + Sync + 'static,
{
    if let Some(tls) = tls {
        // The handshake future is about 7 KiB: boxed, it is allocated only for TLS
        // connections and only while they handshake, instead of being part of every
        // connection's task for its whole life.
        let Some(mut stream) = Box::pin(tls.accept(tcp, first_bytes_timeout)).await else {
            return;
        };
        if stream.selected_alpn_proto() == Some(ALPN::H2) {
            let _ = h1.process_new(stream, &shutdown).await;
            return;
        }
        let read = match fast {
            None => BytesMut::new(),
            Some(states) => match serve_fast(&mut stream, &states, &shutdown).await {
                ConnectionEnd::Done => {
                    // TLS ends with close_notify, so that the client can tell the end of
                    // an answer from a cut connection.
                    let _ = timeout(TLS_CLOSE_WAIT, AsyncWriteExt::shutdown(&mut stream)).await;
                    return;
                }
                ConnectionEnd::Handover(read) => read,
            },
        };
        serve_h1(&h1, stream, read, &shutdown).await;
        return;
    }
    let h2c = match h2c {
        None => None,
        Some(h2c) => match timeout(first_bytes_timeout, opens_with_preface(&tcp)).await {
            Ok(Some(true)) => Some(h2c),
            Ok(Some(false)) => None,
            Ok(None) | Err(_) => return,
        },
    };
    if let Some(h2c) = h2c {
        // Pingora hands back a stream only for protocols it does not finish itself.
        let _ = h2c
            .process_new(Box::new(L4Stream::from(tcp)), &shutdown)
            .await;
        return;
    }
    let read = match fast {
        None => BytesMut::new(),
        Some(states) => match serve_fast(&mut tcp, &states, &shutdown).await {
            ConnectionEnd::Done => return,
            ConnectionEnd::Handover(read) => read,
        },
    };
    serve_h1(&h1, Box::new(L4Stream::from(tcp)), read, &shutdown).await;
}

/// Serves an HTTP/1 connection whose first bytes, `read`, were already read (by the fast
/// path), request after request while it is kept alive: what pingora's
/// [`ServerApp::process_new`] does for HTTP/1, without its boxed future (about 4 KiB, most
/// of it the HTTP/2 handshake), which would otherwise stay allocated for the whole life of
/// every HTTP/1 connection.
async fn serve_h1<A>(app: &Arc<A>, stream: Stream, read: BytesMut, shutdown: &ShutdownWatch)
where
    A: HttpServerApp + Send + Sync + 'static,
{
    let mut first = HttpSession::new(stream);
    if !read.is_empty() {
        first.set_pipelined_prefix(read);
    }
    let mut session = ServerSession::H1(first);
    session.set_keepalive((!*shutdown.borrow()).then_some(H1_KEEPALIVE_SECS));
    session.set_keepalive_reuses_remaining(
        app.server_options()
            .and_then(|options| options.keepalive_request_limit),
    );
    let mut reused = app.process_new_http(session, shutdown).await;
    while let Some((stream, settings)) = reused.map(ReusedHttpStream::consume) {
        let mut session = ServerSession::new_http1(stream);
        if let Some(settings) = settings {
            settings.apply_to_session(&mut session);
        }
        reused = app.process_new_http(session, shutdown).await;
    }
}

/// Peeks at the first bytes: `Some(true)` for the h2 preface, `Some(false)`
/// for anything else, `None` when the client closed without sending.
async fn opens_with_preface(tcp: &TcpStream) -> Option<bool> {
    let mut buf = [0u8; H2_PREFACE.len()];
    loop {
        let n = tcp.peek(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        if buf[..n] != H2_PREFACE[..n] {
            return Some(false);
        }
        if n == H2_PREFACE.len() {
            return Some(true);
        }
        // A partial preface: wait for the rest (peek does not consume).
        sleep(PREFACE_POLL).await;
    }
}

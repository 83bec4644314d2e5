//! The keep-alive client of plaintext HTTP/1.1 engines: a pool of idle TCP connections per
//! engine address ([`ConnectionPool`]) and one round trip on a connection ([`Roundtrip`]):
//! the request head and body written in one `writev` (or, for a body that streams, the head
//! and each piece as it comes), the response head parsed in place and the body read by its
//! framing.

use std::collections::HashMap;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout};

use crate::body::{BadFraming, Decoded, Framing};
use crate::digits::push_hex;
use crate::fields::listed_in_connection;
use crate::head::{Known, Parsed, ResponseHead, parse_response};
use crate::lazy_timer::{Elapsed, LazyTimer};
use crate::strict::{Violation, response_framing};

/// Longest response head accepted from an engine.
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// Room reserved in a connection's buffer before each read.
const READ_RESERVE: usize = 16 * 1024;

/// Initial room for a connection's request heads.
const HEAD_CAPACITY: usize = 512;

/// An open connection to an engine, what it has read ahead, and what its requests reuse:
/// the buffer request heads are written into, and the timer of their deadlines.
#[derive(Debug)]
struct Connection {
    tcp: TcpStream,
    buf: BytesMut,
    head: Vec<u8>,
    timer: LazyTimer,
}

impl Connection {
    /// Whether the idle connection has nothing to read: neither a close from the engine nor
    /// bytes it should not have sent between responses.
    fn is_quiet(&self) -> bool {
        let mut probe = [0u8; 1];
        matches!(self.tcp.try_read(&mut probe), Err(error) if error.kind() == io::ErrorKind::WouldBlock)
    }
}

/// Idle engine connections, per engine address.
#[derive(Debug)]
pub struct ConnectionPool {
    idle: Mutex<HashMap<SocketAddr, Vec<(Connection, Instant)>>>,
    per_peer: usize,
    idle_timeout: Duration,
}

impl ConnectionPool {
    /// Keeps up to `per_peer` idle connections per engine, each for up to `idle_timeout`.
    pub fn new(per_peer: usize, idle_timeout: Duration) -> Self {
        Self {
            idle: Mutex::new(HashMap::new()),
            per_peer,
            idle_timeout,
        }
    }

    /// The most recently returned idle connection to `addr` that has not idled out and that
    /// the engine has not closed meanwhile.
    ///
    /// Engines behind Python servers close idle connections early (vLLM's, SGLang's and
    /// TensorRT-LLM's uvicorn after 5 s); every connection idle since a burst goes stale at
    /// once, and a request that met two of them in turn failed with "closed the connection
    /// before responding". A close that has reached this host shows as readiness to read,
    /// which costs no system call to look at while the connection is quiet.
    fn take(&self, addr: SocketAddr) -> Option<Connection> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let connections = idle.get_mut(&addr)?;
        let now = Instant::now();
        while let Some((connection, since)) = connections.pop() {
            if now.duration_since(since) < self.idle_timeout && connection.is_quiet() {
                return Some(connection);
            }
        }
        None
    }

    /// Keeps `connection` for reuse (closed when the pool for `addr` is full).
    fn put(&self, addr: SocketAddr, connection: Connection) {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let connections = idle.entry(addr).or_default();
        if connections.len() < self.per_peer {
            connections.push((connection, Instant::now()));
        }
    }
}

/// Why a round trip with an engine failed.
#[derive(Debug)]
pub enum RoundtripError {
    /// Connecting failed or timed out.
    Connect(io::Error),
    /// The connection broke, or the engine sent something that is not HTTP/1.
    Broken(String),
    /// The engine's response head frames its body ambiguously or in a way kvmesh does not
    /// read ([`crate::strict`]); the connection is closed.
    Malformed(Violation),
}

impl std::fmt::Display for RoundtripError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RoundtripError::Connect(error) => write!(f, "connect: {error}"),
            RoundtripError::Broken(detail) => f.write_str(detail),
            RoundtripError::Malformed(violation) => {
                write!(f, "malformed response head: {}", violation.describe())
            }
        }
    }
}

/// One round trip on an engine connection: a request, then its response.
#[derive(Debug)]
pub struct Roundtrip {
    connection: Connection,
    addr: SocketAddr,
    head: Option<ResponseHead>,
    framing: Framing,
    /// The engine lets the connection be reused after this response.
    keep_alive: bool,
    /// The engine closed the connection.
    eof: bool,
    /// The body's first piece, decoded ahead by [`Roundtrip::check_buffered`].
    lookahead: Option<Result<Option<Bytes>, RoundtripError>>,
}

/// No response head (`first_byte`) or no body piece (`idle`) within its time limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedOut;

impl Roundtrip {
    /// A round trip on a pooled connection to `addr` (the flag is true) or a new one.
    pub async fn open(
        pool: &ConnectionPool,
        addr: SocketAddr,
        connect_timeout: Option<Duration>,
    ) -> Result<(Self, bool), RoundtripError> {
        let (connection, reused) = match pool.take(addr) {
            Some(connection) => (connection, true),
            None => (connect(addr, connect_timeout).await?, false),
        };
        let roundtrip = Self {
            connection,
            addr,
            head: None,
            framing: Framing::Length(0),
            keep_alive: false,
            eof: false,
            lookahead: None,
        };
        Ok((roundtrip, reused))
    }

    /// A round trip on a new connection to `addr`, never a pooled one: for a request whose
    /// body streams, which a pooled connection the engine closed meanwhile would fail after
    /// bytes that cannot be sent again.
    pub async fn open_new(
        addr: SocketAddr,
        connect_timeout: Option<Duration>,
    ) -> Result<Self, RoundtripError> {
        Ok(Self {
            connection: connect(addr, connect_timeout).await?,
            addr,
            head: None,
            framing: Framing::Length(0),
            keep_alive: false,
            eof: false,
            lookahead: None,
        })
    }

    /// The request head to send, empty: written by the caller, sent by [`Roundtrip::request`].
    #[inline]
    pub fn request_head(&mut self) -> &mut Vec<u8> {
        self.connection.head.clear();
        &mut self.connection.head
    }

    /// Writes the request head and `body` (one `writev` when the socket takes it all).
    async fn send(&mut self, body: &[u8]) -> Result<(), RoundtripError> {
        self.write_parts([&[], body, &[]]).await
    }

    /// Writes what is left of the request head (nothing once sent), then `parts` in order,
    /// with vectored writes.
    async fn write_parts(&mut self, mut parts: [&[u8]; 3]) -> Result<(), RoundtripError> {
        let Connection { tcp, head, .. } = &mut self.connection;
        let mut head_left: &[u8] = head;
        loop {
            let slices = [
                IoSlice::new(head_left),
                IoSlice::new(parts[0]),
                IoSlice::new(parts[1]),
                IoSlice::new(parts[2]),
            ];
            let Some(first) = slices.iter().position(|slice| !slice.is_empty()) else {
                break;
            };
            let mut written = match tcp.write_vectored(&slices[first..]).await {
                Ok(0) => {
                    return Err(RoundtripError::Broken(
                        "the engine closed the connection".into(),
                    ));
                }
                Ok(n) => n,
                Err(error) => return Err(RoundtripError::Broken(format!("write: {error}"))),
            };
            for part in std::iter::once(&mut head_left).chain(parts.iter_mut()) {
                let taken = written.min(part.len());
                *part = &part[taken..];
                written -= taken;
            }
        }
        head.clear();
        Ok(())
    }

    /// Sends the request head when not sent yet, then `piece` of the body, within `limit`:
    /// chunk-encoded when `chunked` (then an empty `piece` is the last chunk), else as it is.
    pub async fn send_within(
        &mut self,
        piece: &[u8],
        chunked: bool,
        limit: Duration,
    ) -> Result<Result<(), RoundtripError>, TimedOut> {
        self.within(limit, async |roundtrip| {
            if !chunked {
                return roundtrip.write_parts([piece, &[], &[]]).await;
            }
            let mut size = Vec::with_capacity(20);
            push_hex(&mut size, piece.len());
            size.extend_from_slice(b"\r\n");
            roundtrip.write_parts([&size, piece, b"\r\n"]).await
        })
        .await
    }

    /// Reads the response head within `limit`, once the request is sent
    /// ([`Roundtrip::send_within`]).
    pub async fn read_head_within(
        &mut self,
        limit: Duration,
    ) -> Result<Result<(), RoundtripError>, TimedOut> {
        self.within(limit, async |roundtrip| roundtrip.read_head().await)
            .await
    }

    /// Sends the request (head and `body`) and reads the response head, within `limit`.
    pub async fn request(
        &mut self,
        body: &[u8],
        limit: Duration,
    ) -> Result<Result<(), RoundtripError>, TimedOut> {
        self.within(limit, async |roundtrip| {
            roundtrip.send(body).await?;
            roundtrip.read_head().await
        })
        .await
    }

    /// The next piece of the body within `limit`; `None` at its end.
    pub async fn read_body_within(
        &mut self,
        limit: Duration,
    ) -> Result<Result<Option<Bytes>, RoundtripError>, TimedOut> {
        self.within(limit, async |roundtrip| roundtrip.read_body().await)
            .await
    }

    /// Runs `work` on this round trip for at most `limit`, on the connection's timer (taken
    /// out meanwhile and put back after; a round trip cancelled meanwhile is not reused: its
    /// connection closes).
    async fn within<T>(
        &mut self,
        limit: Duration,
        work: impl AsyncFnOnce(&mut Self) -> T,
    ) -> Result<T, TimedOut> {
        let mut timer = std::mem::take(&mut self.connection.timer);
        let outcome = timer.within(limit, work(self)).await;
        self.connection.timer = timer;
        outcome.map_err(|Elapsed| TimedOut)
    }

    /// Reads the response head (skipping `1xx` interim responses).
    async fn read_head(&mut self) -> Result<(), RoundtripError> {
        loop {
            let head = loop {
                match parse_response(&mut self.connection.buf) {
                    Parsed::Complete(head) => break head,
                    Parsed::Invalid => {
                        return Err(RoundtripError::Broken("invalid response head".into()));
                    }
                    Parsed::Partial if self.connection.buf.len() > MAX_RESPONSE_HEAD => {
                        return Err(RoundtripError::Broken("response head too large".into()));
                    }
                    Parsed::Partial => {
                        if self.fill().await? == 0 {
                            return Err(RoundtripError::Broken(
                                "the engine closed the connection before responding".into(),
                            ));
                        }
                    }
                }
            };
            if (100..200).contains(&head.status) {
                continue;
            }
            self.framing = response_framing(&head).map_err(RoundtripError::Malformed)?;
            self.keep_alive = keeps_alive(&head) && self.framing != Framing::Close;
            self.head = Some(head);
            return Ok(());
        }
    }

    /// The response head, once read.
    #[inline]
    pub fn head(&self) -> Option<&ResponseHead> {
        self.head.as_ref()
    }

    /// Whether the body is delimited by its `Content-Length` (or has none by its status).
    #[inline]
    pub fn length_framed(&self) -> bool {
        matches!(self.framing, Framing::Length(_))
    }

    /// Whether body bytes (or the body's end) are already buffered, so that reading the
    /// body's first piece will not wait.
    #[inline]
    pub fn body_ready(&self) -> bool {
        self.lookahead.is_some() || !self.connection.buf.is_empty() || self.framing.is_done()
    }

    /// Decodes the body's first piece now when it is already buffered, so that a body
    /// framed wrongly from its start shows before anything of the response is relayed
    /// (the error); [`Roundtrip::take_buffered`] returns the piece next.
    pub fn check_buffered(&mut self) -> Result<(), RoundtripError> {
        if self.lookahead.is_none() {
            self.lookahead = self.decode_buffered();
        }
        match self.lookahead.take() {
            Some(Err(error)) => Err(error),
            ahead => {
                self.lookahead = ahead;
                Ok(())
            }
        }
    }

    /// The next piece of the body; `None` at its end.
    async fn read_body(&mut self) -> Result<Option<Bytes>, RoundtripError> {
        loop {
            if let Some(read) = self.take_buffered() {
                return read;
            }
            if self.fill().await? == 0 {
                self.eof = true;
            }
        }
    }

    /// The next piece of the body when it is already read (`None`: reading must wait).
    #[inline]
    pub fn take_buffered(&mut self) -> Option<Result<Option<Bytes>, RoundtripError>> {
        self.lookahead.take().or_else(|| self.decode_buffered())
    }

    fn decode_buffered(&mut self) -> Option<Result<Option<Bytes>, RoundtripError>> {
        match self.framing.decode(&mut self.connection.buf, self.eof) {
            Ok(Decoded::Data(data)) => Some(Ok(Some(data))),
            Ok(Decoded::End) => Some(Ok(None)),
            Ok(Decoded::NeedMore) => None,
            Err(BadFraming) => Some(Err(RoundtripError::Broken(
                "the engine's body ended early or is badly framed".into(),
            ))),
        }
    }

    /// Returns the connection to `pool` when the whole response was read and the engine
    /// keeps it open; otherwise closes it.
    pub fn release(self, pool: &ConnectionPool) {
        if self.keep_alive && !self.eof && self.framing.is_done() && self.connection.buf.is_empty()
        {
            pool.put(self.addr, self.connection);
        }
    }

    /// Reads more from the engine; the number of bytes (0 at EOF).
    async fn fill(&mut self) -> Result<usize, RoundtripError> {
        let connection = &mut self.connection;
        connection.buf.reserve(READ_RESERVE);
        connection
            .tcp
            .read_buf(&mut connection.buf)
            .await
            .map_err(|error| RoundtripError::Broken(format!("read: {error}")))
    }
}

/// A new connection to `addr`, with `TCP_NODELAY`.
async fn connect(addr: SocketAddr, limit: Option<Duration>) -> Result<Connection, RoundtripError> {
    let connecting = TcpStream::connect(addr);
    let tcp = match limit {
        Some(limit) => timeout(limit, connecting).await.map_err(|_| {
            RoundtripError::Connect(io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))
        })?,
        None => connecting.await,
    }
    .map_err(RoundtripError::Connect)?;
    tcp.set_nodelay(true).map_err(RoundtripError::Connect)?;
    Ok(Connection {
        tcp,
        buf: BytesMut::with_capacity(READ_RESERVE),
        head: Vec::with_capacity(HEAD_CAPACITY),
        timer: LazyTimer::default(),
    })
}

/// Whether the engine keeps the connection open after this response.
fn keeps_alive(head: &ResponseHead) -> bool {
    let connection = head.fields.get(Known::Connection);
    if head.minor_version == 0 {
        connection.is_some_and(|value| listed_in_connection(value, b"keep-alive"))
    } else {
        !connection.is_some_and(|value| listed_in_connection(value, b"close"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// An engine that answers each request on a connection with `responses`, in turn, then
    /// closes it.
    async fn engine(responses: Vec<&'static [u8]>) -> SocketAddr {
        serve(responses, false).await
    }

    /// [`engine`], keeping the connection open after the responses until the client closes.
    async fn engine_holding(responses: Vec<&'static [u8]>) -> SocketAddr {
        serve(responses, true).await
    }

    async fn serve(responses: Vec<&'static [u8]>, hold: bool) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            for response in responses {
                let mut buf = vec![0; 4096];
                let mut read = Vec::new();
                while !read.windows(4).any(|window| window == b"\r\n\r\n") {
                    let n = tcp.read(&mut buf).await.unwrap();
                    read.extend_from_slice(&buf[..n]);
                }
                tcp.write_all(response).await.unwrap();
            }
            if hold {
                let _ = tcp.read(&mut [0; 1]).await;
            }
        });
        addr
    }

    /// Sends `GET /` and reads the response head.
    async fn get(roundtrip: &mut Roundtrip) {
        roundtrip
            .request_head()
            .extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        roundtrip.send(b"").await.unwrap();
        roundtrip.read_head().await.unwrap();
    }

    async fn body(roundtrip: &mut Roundtrip) -> Vec<u8> {
        let mut body = Vec::new();
        while let Some(piece) = roundtrip.read_body().await.unwrap() {
            body.extend_from_slice(&piece);
        }
        body
    }

    #[tokio::test]
    async fn connections_are_reused_after_whole_responses() {
        let addr = engine_holding(vec![
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
        ])
        .await;
        let pool = ConnectionPool::new(4, Duration::from_secs(60));
        for expected in [&b"ok"[..], b"hi"] {
            let (mut roundtrip, _) = Roundtrip::open(&pool, addr, None).await.unwrap();
            get(&mut roundtrip).await;
            assert_eq!(roundtrip.head().unwrap().status, 200);
            assert_eq!(body(&mut roundtrip).await, expected);
            roundtrip.release(&pool);
        }
        let (_, reused) = Roundtrip::open(&pool, addr, None).await.unwrap();
        assert!(reused, "the second response left the connection reusable");
    }

    #[tokio::test]
    async fn a_pooled_connection_the_engine_closed_is_not_reused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            // One response, then the idle connection is closed (uvicorn's keep-alive timeout).
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut buf = vec![0; 4096];
            let _ = tcp.read(&mut buf).await.unwrap();
            tcp.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            drop(tcp);
            closed_tx.send(()).unwrap();
            // A new connection is served.
            let (mut tcp, _) = listener.accept().await.unwrap();
            let _ = tcp.read(&mut buf).await.unwrap();
            tcp.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nnew")
                .await
                .unwrap();
            let _ = tcp.read(&mut buf).await;
        });
        let pool = ConnectionPool::new(4, Duration::from_secs(60));
        let (mut roundtrip, _) = Roundtrip::open(&pool, addr, None).await.unwrap();
        get(&mut roundtrip).await;
        let mut bodies = vec![body(&mut roundtrip).await];
        roundtrip.release(&pool);
        closed_rx.await.unwrap();
        // Until the close reaches the pooled socket's readiness, the pool still offers it.
        tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(connection) = pool.take(addr) {
                pool.put(addr, connection);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the engine's close reaches the pool");
        let (mut roundtrip, reused) = Roundtrip::open(&pool, addr, None).await.unwrap();
        assert!(!reused, "the closed connection was skipped for a new one");
        get(&mut roundtrip).await;
        bodies.push(body(&mut roundtrip).await);
        assert_eq!(bodies, [&b"ok"[..], b"new"]);
    }

    #[tokio::test]
    async fn close_delimited_and_closing_responses_are_not_pooled() {
        let addr = engine(vec![
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 1\r\n\r\nx",
        ])
        .await;
        let pool = ConnectionPool::new(4, Duration::from_secs(60));
        let (mut roundtrip, reused) = Roundtrip::open(&pool, addr, None).await.unwrap();
        assert!(!reused);
        roundtrip
            .request_head()
            .extend_from_slice(b"GET / HTTP/1.1\r\n");
        roundtrip.send(b"\r\n").await.unwrap();
        roundtrip.read_head().await.unwrap();
        assert_eq!(body(&mut roundtrip).await, b"x");
        roundtrip.release(&pool);
        assert!(pool.take(addr).is_none());
    }

    #[tokio::test]
    async fn a_body_cut_short_is_an_error() {
        let addr = engine(vec![b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"]).await;
        let pool = ConnectionPool::new(4, Duration::from_secs(60));
        let (mut roundtrip, _) = Roundtrip::open(&pool, addr, None).await.unwrap();
        get(&mut roundtrip).await;
        assert_eq!(roundtrip.read_body().await.unwrap().unwrap(), &b"abc"[..]);
        assert!(roundtrip.read_body().await.is_err());
    }

    #[tokio::test]
    async fn ambiguous_or_badly_chunked_responses_are_refused_and_not_pooled() {
        let cases: [(&'static [u8], Option<Violation>); 4] = [
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
                Some(Violation::LengthAndCoding),
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
                Some(Violation::ContentLength),
            ),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
                Some(Violation::TransferCoding),
            ),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3;\x00\r\nabc\r\n0\r\n\r\n",
                None,
            ),
        ];
        for (response, violation) in cases {
            let addr = engine(vec![response]).await;
            let pool = ConnectionPool::new(4, Duration::from_secs(60));
            let (mut roundtrip, _) = Roundtrip::open(&pool, addr, None).await.unwrap();
            roundtrip
                .request_head()
                .extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
            roundtrip.send(b"").await.unwrap();
            match (roundtrip.read_head().await, violation) {
                (Err(RoundtripError::Malformed(seen)), Some(expected)) => {
                    assert_eq!(seen, expected);
                }
                (Ok(()), None) => assert!(roundtrip.read_body().await.is_err()),
                (read, _) => panic!("{read:?} for {:?}", String::from_utf8_lossy(response)),
            }
            roundtrip.release(&pool);
            assert!(pool.take(addr).is_none(), "the connection is not reused");
        }
    }

    #[tokio::test]
    async fn refused_connections_are_connect_errors() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let pool = ConnectionPool::new(4, Duration::from_secs(60));
        let opened = Roundtrip::open(&pool, addr, Some(Duration::from_secs(1))).await;
        assert!(matches!(opened, Err(RoundtripError::Connect(_))));
    }

    #[tokio::test]
    async fn a_streamed_body_goes_out_piece_by_piece_on_a_new_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut read = Vec::new();
            let mut buf = vec![0; 4096];
            while !read.ends_with(b"0\r\n\r\n") {
                let n = tcp.read(&mut buf).await.unwrap();
                assert_ne!(n, 0, "the request ended early: {read:?}");
                read.extend_from_slice(&buf[..n]);
            }
            tcp.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            seen_tx.send(read).unwrap();
            let _ = tcp.read(&mut buf).await;
        });
        let pool = ConnectionPool::new(4, Duration::from_secs(60));
        // A pooled connection to the address is not taken.
        let mut roundtrip = Roundtrip::open_new(addr, None).await.unwrap();
        let head = b"POST /up HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n";
        roundtrip.request_head().extend_from_slice(head);
        let limit = Duration::from_secs(5);
        for piece in [&b"first"[..], &[b'x'; 300], b""] {
            roundtrip
                .send_within(piece, true, limit)
                .await
                .unwrap()
                .unwrap();
        }
        roundtrip.read_head_within(limit).await.unwrap().unwrap();
        assert_eq!(roundtrip.head().unwrap().status, 200);
        assert_eq!(body(&mut roundtrip).await, b"ok");
        let mut expected = head.to_vec();
        expected.extend_from_slice(b"5\r\nfirst\r\n12c\r\n");
        expected.extend_from_slice(&[b'x'; 300]);
        expected.extend_from_slice(b"\r\n0\r\n\r\n");
        assert_eq!(seen_rx.await.unwrap(), expected);
        roundtrip.release(&pool);
        assert!(
            pool.take(addr).is_some(),
            "the whole exchange leaves it reusable"
        );
    }
}

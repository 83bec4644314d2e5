//! The client connections the fast path serves: plaintext TCP, and TLS once its handshake
//! chose HTTP/1.1 ([`ClientIo`]). Both are read the same way: what is already waiting is
//! taken without arming a timer, and while a request is served the connection is read ahead
//! (pipelined bytes kept) to see the client leave.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};

use bytes::BytesMut;
use pingora_core::protocols::IO;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::io::poll_read_buf;

/// Room reserved in a read buffer before each read.
pub(crate) const READ_RESERVE: usize = 8 * 1024;

/// A client connection of the fast path.
pub(crate) trait ClientIo: AsyncRead + AsyncWrite + Unpin + Send {
    /// Reads what is already waiting into `buf` without waiting (`WouldBlock`: nothing is).
    fn try_read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize>;

    /// Reads into `buf` once the client sent something (`Ok(0)`: it closed), growing `buf`
    /// only then: while a request is served, its body may still share `buf`'s allocation, so
    /// growing it on every poll would allocate anew each time.
    fn poll_read_ahead(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>>;
}

impl ClientIo for TcpStream {
    fn try_read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        TcpStream::try_read_buf(self, buf)
    }

    fn poll_read_ahead(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        // The socket's own read-readiness slot, not `readable()`, which queues and unqueues
        // a waiter each time its future is created and dropped: once per request and piece.
        loop {
            ready!(self.poll_read_ready(cx))?;
            buf.reserve(READ_RESERVE);
            match TcpStream::try_read_buf(self, buf) {
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                read => return Poll::Ready(read),
            }
        }
    }
}

/// A TLS connection: pingora's [`Stream`](pingora_core::protocols::Stream), its handshake
/// done. Written for any lifetime, as the futures that hold one are checked for `Send` over
/// every lifetime.
impl ClientIo for Box<dyn IO + '_> {
    fn try_read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        // Decrypted bytes already here come back at once; otherwise nothing waits on them.
        let mut cx = Context::from_waker(Waker::noop());
        match poll_read_buf(Pin::new(self), &mut cx, buf) {
            Poll::Ready(read) => read,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn poll_read_ahead(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        // `poll_read_buf` grows a full `buf` by a little, and only when it reads.
        poll_read_buf(Pin::new(self), cx, buf)
    }
}

//! Closing a server connection whose client may still be writing: the answer came before
//! the whole request was read (413 on a declared length, 400 on bad framing, 401 before
//! the body). Closing a socket with unread input makes the kernel send a reset, and a
//! client still writing its body (Python's `urllib` writes all of it before it reads) then
//! gets a broken pipe instead of the answer waiting in its receive buffer.
//!
//! So, as nginx's lingering close does: the answer is written, the sending side is shut
//! down (the client sees the answer end), and what the client still sends is read and
//! discarded until it closes too, for at most [`LINGER_TIME`] in all, [`LINGER_IDLE`]
//! without a byte, or [`LINGER_BYTES`] (nginx: 30 s and 5 s, no byte limit; these bounds
//! are tighter, since a connection lingering is one the proxy holds for nothing).

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, timeout_at};

/// Longest time a connection lingers.
pub const LINGER_TIME: Duration = Duration::from_secs(5);

/// Longest wait for the client's next bytes while lingering.
pub const LINGER_IDLE: Duration = Duration::from_secs(1);

/// Most bytes read and discarded while lingering.
pub const LINGER_BYTES: u64 = 64 * 1024 * 1024;

/// Room for each read while lingering (allocated only then).
const SCRATCH: usize = 16 * 1024;

/// Shuts `stream`'s sending side down (flushing what was written), then reads and
/// discards until the client closes, or one of the bounds is reached; `stream` is closed
/// when it is dropped (by the caller, when it passed a reference).
pub async fn lingering_close<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let end = Instant::now() + LINGER_TIME;
    let mut scratch = vec![0; SCRATCH];
    let mut discarded = 0u64;
    while discarded < LINGER_BYTES {
        let wait = end.min(Instant::now() + LINGER_IDLE);
        match timeout_at(wait, stream.read(&mut scratch)).await {
            Ok(Ok(read)) if read > 0 => discarded += read as u64,
            // The client closed, the connection broke, or time is up.
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    #[tokio::test]
    async fn a_client_writing_its_whole_body_first_reads_the_early_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut head = [0u8; 64];
            let _ = tcp.read(&mut head).await.unwrap();
            tcp.write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
            lingering_close(tcp).await;
        });
        let mut client = TcpStream::connect(addr).await.unwrap();
        // Far more than the socket buffers hold: without lingering, the server's close
        // resets the connection while this is still being written.
        let body = vec![b'x'; 32 * 1024 * 1024];
        client.write_all(b"POST / HTTP/1.1\r\n").await.unwrap();
        client.write_all(&body).await.unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert!(answer.starts_with(b"HTTP/1.1 413"));
        drop(client);
        server.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn lingering_is_bounded_in_time() {
        // A client that sends nothing more and never closes: one idle wait.
        let (_client, server) = tokio::io::duplex(1024);
        let started = Instant::now();
        lingering_close(server).await;
        assert_eq!(started.elapsed(), LINGER_IDLE);

        // A client that keeps trickling bytes: the whole linger time.
        let (mut client, server) = tokio::io::duplex(1024);
        let trickle = tokio::spawn(async move {
            while client.write_all(b"x").await.is_ok() {
                tokio::time::sleep(LINGER_IDLE / 2).await;
            }
        });
        let started = Instant::now();
        lingering_close(server).await;
        assert_eq!(started.elapsed(), LINGER_TIME);
        trickle.await.unwrap();
    }
}

//! Reading the client's request body on a pingora session: whole (the model must be known
//! before routing), within the size limit and the client deadline, or (a body that streams)
//! its start, then piece by piece.

use bytes::{Bytes, BytesMut};
use pingora_core::protocols::http::ServerSession;
use pingora_error::ErrorType;
use tokio::time::{Instant, timeout_at};

/// Pingora's error type for a chunk-size line or chunk end it refuses.
const INVALID_CHUNK: ErrorType = ErrorType::new("InvalidChunk");

/// Pingora's error type for a trailer section it refuses.
const INVALID_TRAILER_END: ErrorType = ErrorType::new("InvalidTrailerEnd");

/// Why the body could not be read.
#[derive(Debug)]
pub(crate) enum BodyError {
    /// More than the limit arrived.
    TooLarge,
    /// The deadline passed.
    Timeout,
    /// The chunked body is malformed.
    Malformed,
    /// The client broke the connection.
    Client(Box<pingora_error::Error>),
}

/// Reads the whole body. A body that arrives in one piece (the common case) is returned
/// without a copy; otherwise the pieces are joined once.
pub(crate) async fn read_body(
    session: &mut ServerSession,
    limit: u64,
    size_hint: Option<u64>,
    deadline: Instant,
) -> Result<Bytes, BodyError> {
    let (body, _) = read_body_start(session, limit, size_hint, deadline, None).await?;
    Ok(body)
}

/// [`read_body`], or (`window` given) only the body's first `window` bytes or more; `true`
/// with the bytes when the body ended.
pub(crate) async fn read_body_start(
    session: &mut ServerSession,
    limit: u64,
    size_hint: Option<u64>,
    deadline: Instant,
    window: Option<usize>,
) -> Result<(Bytes, bool), BodyError> {
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut total: u64 = 0;
    let window = window.map_or(u64::MAX, |window| window as u64);
    let ended = loop {
        if total >= window {
            break false;
        }
        let Some(chunk) = read_piece(session, deadline).await? else {
            break true;
        };
        total = total.saturating_add(chunk.len() as u64);
        if total > limit {
            return Err(BodyError::TooLarge);
        }
        if let Some(buffer) = joined.as_mut() {
            buffer.extend_from_slice(&chunk);
        } else if let Some(head) = first.take() {
            let capacity = size_hint.map_or(0, |n| n.min(limit).min(window)) as usize;
            let mut buffer = BytesMut::with_capacity(capacity.max(head.len() + chunk.len()));
            buffer.extend_from_slice(&head);
            buffer.extend_from_slice(&chunk);
            joined = Some(buffer);
        } else {
            first = Some(chunk);
        }
    };
    let body = joined.map(BytesMut::freeze).or(first).unwrap_or_default();
    Ok((body, ended))
}

/// The body's next piece by `deadline`; `None` at its end.
pub(crate) async fn read_piece(
    session: &mut ServerSession,
    deadline: Instant,
) -> Result<Option<Bytes>, BodyError> {
    timeout_at(deadline, session.read_request_body())
        .await
        .map_err(|_| BodyError::Timeout)?
        .map_err(|error| match error.etype() {
            etype if *etype == INVALID_CHUNK || *etype == INVALID_TRAILER_END => {
                BodyError::Malformed
            }
            _ => BodyError::Client(error),
        })
}

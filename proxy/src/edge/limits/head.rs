//! The request head: read within the client timeout, checked against the size
//! and field-count limits. A head that never completes, or that the HTTP/1
//! parser refuses, is answered on the raw connection (there is no parsed
//! request to answer through) and the connection is closed with a lingering close.

use std::time::Duration;

use kvmesh_config::LimitsConfig;
use kvmesh_h1::linger::lingering_close;
use kvmesh_h1::strict::Violation;
use pingora_core::protocols::http::ServerSession;
use pingora_core::server::ShutdownWatch;
use pingora_http::RequestHeader;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::timeout;

use crate::openai::api_error::ApiError;

/// How long a connection may still deliver a request head once shutdown began.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_millis(200);

/// Longest time spent writing an answer to a head that was never parsed.
const RAW_ANSWER_TIMEOUT: Duration = Duration::from_secs(1);

/// Bytes counted per header field besides its name and value (`: ` and CRLF).
const FIELD_OVERHEAD: usize = 4;

/// How reading a request head ended.
#[derive(Debug)]
pub(crate) enum HeadRead {
    /// A head was read.
    Ready,
    /// The client closed the connection, or it idled out between requests, or
    /// shutdown began: close without an answer.
    Closed,
    /// The client started a request and did not finish its head in time.
    TimedOut,
    /// The head is not valid HTTP/1 (or over the parser's own size limits).
    Malformed(Box<pingora_error::Error>),
}

/// Reads the request head within `limit`. Once shutdown begins, a connection
/// gets a short grace to deliver a head already on its way. `fresh`: this is the
/// connection's first request, so a timeout is a slow client, not an idle
/// keep-alive connection.
pub(crate) async fn read_head(
    session: &mut ServerSession,
    limit: Duration,
    shutdown: &ShutdownWatch,
    fresh: bool,
) -> HeadRead {
    let mut shutdown = shutdown.clone();
    let read = timeout(limit, session.read_request());
    tokio::pin!(read);
    let result = if *shutdown.borrow_and_update() {
        timeout(SHUTDOWN_GRACE, &mut read).await
    } else {
        tokio::select! {
            result = &mut read => Ok(result),
            _ = shutdown.changed() => timeout(SHUTDOWN_GRACE, &mut read).await,
        }
    };
    match result {
        Ok(Ok(Ok(true))) => HeadRead::Ready,
        Ok(Ok(Ok(false))) | Err(_) => HeadRead::Closed,
        Ok(Ok(Err(error))) => HeadRead::Malformed(error),
        Ok(Err(_)) if fresh => HeadRead::TimedOut,
        Ok(Err(_)) => HeadRead::Closed,
    }
}

/// The error for a head over `limits` (431), if it is.
pub(crate) fn check_head(request: &RequestHeader, limits: &LimitsConfig) -> Result<(), ApiError> {
    let line = request.method.as_str().len()
        + request
            .uri
            .path_and_query()
            .map_or(1, |path| path.as_str().len());
    let field_bytes = request
        .headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    check_head_size(line, request.headers.len(), field_bytes, limits)
}

/// The error for a head over `limits` (431), if it is: `line` is the length of the method
/// and target, `count` the number of fields and `field_bytes` the length of their names
/// and values.
pub(crate) fn check_head_size(
    line: usize,
    count: usize,
    field_bytes: usize,
    limits: &LimitsConfig,
) -> Result<(), ApiError> {
    if count > limits.max_headers {
        return Err(ApiError::HeadersTooLarge {
            detail: format!(
                "{count} header fields, more than the limit of {}",
                limits.max_headers
            ),
        });
    }
    let line = line + "HTTP/1.1".len() + FIELD_OVERHEAD;
    let bytes = line + field_bytes + count * FIELD_OVERHEAD;
    if bytes as u64 > limits.max_header_bytes {
        return Err(ApiError::HeadersTooLarge {
            detail: format!(
                "the request head is {bytes} bytes, more than the limit of {}",
                limits.max_header_bytes
            ),
        });
    }
    Ok(())
}

/// Answers an HTTP/1 request whose head was never parsed with `error`, written
/// straight to the connection, then closes it. HTTP/2 heads arrive whole, so
/// there is nothing to answer there.
pub(crate) async fn answer_unread_head(session: ServerSession, error: &ApiError) {
    let ServerSession::H1(h1) = session else {
        return;
    };
    answer_raw(&mut h1.into_inner(), error).await;
}

/// Writes `error` as a whole HTTP/1.1 response with `connection: close` straight to
/// `stream`, then closes it with a lingering close (the client may still be sending).
pub(crate) async fn answer_raw<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    error: &ApiError,
) {
    let body = error.body();
    let status =
        http::StatusCode::from_u16(error.status()).unwrap_or(http::StatusCode::BAD_REQUEST);
    let head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len(),
    );
    let written = timeout(RAW_ANSWER_TIMEOUT, async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(&body).await?;
        stream.flush().await
    })
    .await;
    if !matches!(written, Ok(Ok(()))) {
        tracing::debug!("could not answer an unread request head");
        return;
    }
    // Boxed: the future exists only while a connection lingers.
    Box::pin(lingering_close(stream)).await;
}

/// The error for a head the HTTP/1 parser refused: 431 when it was over the
/// parser's own limits; 400 `invalid_framing` when pingora's own RFC 9112 checks refused its
/// framing, `Host` or target (as kvmesh's would have: `kvmesh_h1::strict`); 400
/// `malformed_request` otherwise.
pub(crate) fn malformed_head_error(error: &pingora_error::Error) -> ApiError {
    let text = error.to_string();
    if text.contains("TooManyHeaders") || text.contains("larger than") {
        return ApiError::HeadersTooLarge {
            detail: "the request head is over the parser's limits".to_string(),
        };
    }
    // Pingora's own explanations (`validate_request`, `validate_request_authority`): errors
    // without a cause, whose context is the explanation (a parser error's context quotes
    // the request, so it is not looked at).
    let explanation = match (&error.cause, &error.context) {
        (None, Some(context)) => context.as_str(),
        _ => return ApiError::MalformedRequest,
    };
    let violation = if explanation.contains("Transfer-Encoding") {
        Violation::TransferCoding
    } else if explanation.contains("Content-Length") {
        Violation::ContentLength
    } else if explanation.contains("Host header field") || explanation.contains("in Host") {
        Violation::Host
    } else if explanation.contains("authority") || explanation.contains("request target") {
        Violation::Target
    } else {
        return ApiError::MalformedRequest;
    };
    ApiError::InvalidFraming(violation)
}

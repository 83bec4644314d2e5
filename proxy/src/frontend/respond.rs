//! Responses the proxy writes itself (errors, the model list, admin pages).

use bytes::Bytes;
use http::HeaderValue;
use http::header;
use pingora_core::protocols::http::ServerSession;
use pingora_http::ResponseHeader;

use crate::metrics::families::Metrics;
use crate::openai::api_error::ApiError;
use crate::openai::headers::X_REQUEST_ID;
use crate::request::record::Record;

/// `application/json`.
pub(crate) const JSON: HeaderValue = HeaderValue::from_static("application/json");

/// Writes a complete response; `false` when the client is gone.
pub(crate) async fn respond(
    session: &mut ServerSession,
    status: u16,
    content_type: HeaderValue,
    extra: &[(header::HeaderName, HeaderValue)],
    body: Bytes,
) -> bool {
    let Ok(mut response) = ResponseHeader::build(status, Some(3 + extra.len())) else {
        return false;
    };
    let built = response
        .insert_header(header::CONTENT_TYPE, content_type)
        .and_then(|()| response.insert_header(header::CONTENT_LENGTH, body.len()))
        .and_then(|()| {
            extra
                .iter()
                .try_for_each(|(name, value)| response.insert_header(name.clone(), value.clone()))
        });
    if built.is_err() {
        return false;
    }
    if session
        .write_response_header(Box::new(response))
        .await
        .is_err()
    {
        return false;
    }
    session.write_response_body(body, true).await.is_ok()
}

/// Writes an OpenAI-shaped error, with `Allow` / `Retry-After` where they apply.
pub(crate) async fn respond_error(
    session: &mut ServerSession,
    error: &ApiError,
    request_id: &HeaderValue,
) -> bool {
    let extra = error_headers(error, request_id);
    respond(session, error.status(), JSON, &extra, error.body()).await
}

/// Answers `record`'s request with a proxy-generated error; returns whether the write
/// worked.
pub(crate) async fn reject(
    session: &mut ServerSession,
    record: &mut Record,
    metrics: &Metrics,
    error: &ApiError,
) -> bool {
    record.answered_with(metrics, error);
    let written = respond_error(session, error, &record.request_id).await;
    record.client_gone |= !written;
    written
}

/// The headers an error response carries besides its content type and length:
/// `x-request-id`, and `Allow`, `Retry-After` or `WWW-Authenticate` where they apply.
pub(crate) fn error_headers(
    error: &ApiError,
    request_id: &HeaderValue,
) -> Vec<(header::HeaderName, HeaderValue)> {
    let mut extra = vec![(X_REQUEST_ID, request_id.clone())];
    match error {
        ApiError::MethodNotAllowed { allow } => {
            extra.push((header::ALLOW, HeaderValue::from_static(allow)));
        }
        ApiError::NoHealthyInstance {
            retry_after_secs, ..
        }
        | ApiError::Overloaded {
            retry_after_secs, ..
        }
        | ApiError::RateLimited {
            retry_after_secs, ..
        }
        | ApiError::ConcurrencyLimited {
            retry_after_secs, ..
        } => {
            extra.push((header::RETRY_AFTER, HeaderValue::from(*retry_after_secs)));
        }
        ApiError::Unauthorized { .. } => {
            extra.push((header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")));
        }
        _ => {}
    }
    extra
}

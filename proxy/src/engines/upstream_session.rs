//! An engine's response in progress, whichever client speaks to the engine: our own
//! HTTP/1.1 client for plaintext HTTP/1.1 engines, pingora's for h2c and `https://` ones.

use std::borrow::Cow;
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderName;
use kvmesh_h1::client::{Roundtrip, TimedOut};
use kvmesh_h1::fields::is_event_stream_type;
use kvmesh_h1::head::Known;
use pingora_core::protocols::http::client::HttpSession;
use pingora_http::ResponseHeader;
use tokio::time::timeout;

/// The engine side of a forwarded request, once the response head has been read.
#[expect(
    clippy::large_enum_variant,
    reason = "our client's exchange is the common case: boxing it would cost an allocation per request"
)]
pub(crate) enum UpstreamSession {
    /// Pingora's client (h2c and `https://` engines), boxed: it is several times the size
    /// of ours.
    Pingora(Box<HttpSession>),
    /// Our HTTP/1.1 client (plaintext HTTP/1.1 engines).
    H1(Roundtrip),
}

impl UpstreamSession {
    /// The response status.
    pub(crate) fn status(&self) -> Option<u16> {
        match self {
            UpstreamSession::Pingora(session) => {
                session.response_header().map(|head| head.status.as_u16())
            }
            UpstreamSession::H1(exchange) => exchange.head().map(|head| head.status),
        }
    }

    /// Whether the response is a server-sent-event stream.
    pub(crate) fn is_event_stream(&self) -> bool {
        let content_type = match self {
            UpstreamSession::Pingora(session) => session
                .response_header()
                .and_then(|head| head.headers.get(http::header::CONTENT_TYPE))
                .map(http::HeaderValue::as_bytes),
            UpstreamSession::H1(exchange) => exchange
                .head()
                .and_then(|head| head.fields.get(Known::ContentType)),
        };
        content_type.is_some_and(is_event_stream_type)
    }

    /// The response head as pingora's type (built for our client's responses; fields
    /// that are not valid header names or values are left out).
    pub(crate) fn response_header(&self) -> Option<Cow<'_, ResponseHeader>> {
        match self {
            UpstreamSession::Pingora(session) => session.response_header().map(Cow::Borrowed),
            UpstreamSession::H1(exchange) => {
                let head = exchange.head()?;
                let mut header =
                    ResponseHeader::build(head.status, Some(head.fields.len())).ok()?;
                for (name, value) in head.fields.iter() {
                    let (Ok(name), Ok(value)) = (
                        HeaderName::from_bytes(name),
                        http::HeaderValue::from_bytes(value),
                    ) else {
                        continue;
                    };
                    header.append_header(name, value).ok()?;
                }
                Some(Cow::Owned(header))
            }
        }
    }

    /// Whether the body's first piece is already buffered (reading it will not wait).
    pub(crate) fn body_ready(&self) -> bool {
        match self {
            UpstreamSession::Pingora(_) => false,
            UpstreamSession::H1(exchange) => exchange.body_ready(),
        }
    }

    /// The next piece of the response body when our client has it buffered (`None`: reading
    /// must wait, or the engine is spoken to by pingora).
    pub(crate) fn take_buffered(&mut self) -> Option<Result<Option<Bytes>, String>> {
        match self {
            UpstreamSession::Pingora(_) => None,
            UpstreamSession::H1(exchange) => exchange
                .take_buffered()
                .map(|read| read.map_err(|error| error.to_string())),
        }
    }

    /// The next piece of the response body within `limit`; `None` at its end; `Err` when
    /// the engine broke off or framed the body wrongly.
    pub(crate) async fn read_body_within(
        &mut self,
        limit: Duration,
    ) -> Result<Result<Option<Bytes>, String>, TimedOut> {
        match self {
            UpstreamSession::Pingora(session) => timeout(limit, session.read_response_body())
                .await
                .map(|read| read.map_err(|error| error.to_string()))
                .map_err(|_| TimedOut),
            UpstreamSession::H1(exchange) => exchange
                .read_body_within(limit)
                .await
                .map(|read| read.map_err(|error| error.to_string())),
        }
    }
}

//! The response body type: a complete buffer or an SSE stream.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Response, StatusCode};
use hyper::body::{Body, Frame, SizeHint};
use serde::Serialize;

use super::sse::SseBody;

/// Every response body the engine sends.
#[derive(Debug)]
pub(crate) enum ResponseBody {
    /// A body known up front (taken on the first poll).
    Full(Option<Bytes>),
    /// Server-sent events produced as the scheduler emits tokens.
    Sse(Box<SseBody>),
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Self::Full(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            Self::Sse(sse) => sse.poll_chunk(cx).map(|c| c.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Full(data) => data.is_none(),
            Self::Sse(sse) => sse.is_done(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(Some(d)) => SizeHint::with_exact(d.len() as u64),
            Self::Full(None) => SizeHint::with_exact(0),
            Self::Sse(_) => SizeHint::default(),
        }
    }
}

/// A response with `body` and a content type.
pub(crate) fn bytes_response(
    status: StatusCode,
    content_type: &'static str,
    body: Bytes,
) -> Response<ResponseBody> {
    let mut res = Response::new(ResponseBody::Full(Some(body)));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    res
}

/// A JSON response.
pub(crate) fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response<ResponseBody> {
    match serde_json::to_vec(value) {
        Ok(body) => bytes_response(status, "application/json", Bytes::from(body)),
        // Our response types always serialize; keep a well-formed answer regardless.
        Err(_) => bytes_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "application/json",
            Bytes::from_static(b"{}"),
        ),
    }
}

/// An empty response.
pub(crate) fn empty_response(status: StatusCode) -> Response<ResponseBody> {
    let mut res = Response::new(ResponseBody::Full(None));
    *res.status_mut() = status;
    res
}

//! The client's request body as the spine holds it: whole (read before the spine runs), or
//! streamed. A multipart upload to an engine route (audio) longer than
//! [`MULTIPART_WINDOW`](crate::openai::engine_model::MULTIPART_WINDOW) is handed over with only its start read (where its `model` field
//! is); the rest is read from the client piece by piece while the engine request is sent
//! ([`crate::request::attempt`]), never held whole.
//!
//! A streamed body is sent again (to another instance, on a failure before the engine's
//! answer) only while the client has sent nothing beyond the start the spine holds; once a
//! later piece went to an engine, a failure ends the request.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::openai::api_error::ApiError;
use crate::openai::route::Route;
use crate::request::stop::Stop;

/// A request body as a front end hands it to the spine.
#[derive(Debug, Default)]
pub(crate) struct RequestBody {
    /// The whole body, or a streamed body's start (at least
    /// [`MULTIPART_WINDOW`](crate::openai::engine_model::MULTIPART_WINDOW) bytes).
    pub(crate) read: Bytes,
    /// A streamed body: what follows `read`, still with the client.
    pub(crate) rest: Option<BodyRest>,
}

impl RequestBody {
    /// A body read whole.
    pub(crate) fn whole(read: Bytes) -> Self {
        Self { read, rest: None }
    }
}

/// The part of a streamed body still with the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BodyRest {
    /// The whole body's length, when the client announced it (`None`: chunked).
    pub(crate) length: Option<u64>,
    /// A piece beyond the start was taken from the client: the body cannot be sent again.
    pub(crate) consumed: bool,
}

impl BodyRest {
    /// The rest of a body of `length` (`None`: chunked), nothing of it read yet.
    pub(crate) fn new(length: Option<u64>) -> Self {
        Self {
            length,
            consumed: false,
        }
    }
}

/// How far a front end has read a streamed body, against its size limit and the wait
/// allowed for each piece.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamedRead {
    /// Bytes of the body read so far.
    read: u64,
    /// The body's size limit.
    limit: u64,
    /// The longest wait for each piece.
    idle: Duration,
}

impl StreamedRead {
    /// A body of which `read` bytes are read, limited to `limit`, each piece due within `idle`.
    pub(crate) fn new(read: u64, limit: u64, idle: Duration) -> Self {
        Self { read, limit, idle }
    }

    /// Counts a piece of `len` bytes; too large once past the limit.
    pub(crate) fn count(&mut self, len: usize) -> Result<(), PieceError> {
        self.read = self.read.saturating_add(len as u64);
        self.check(0)
    }

    /// Too large when `announced` more bytes (a chunk's size line) would pass the limit.
    pub(crate) fn check(&self, announced: u64) -> Result<(), PieceError> {
        if self.read.saturating_add(announced) > self.limit {
            return Err(PieceError::TooLarge(self.limit));
        }
        Ok(())
    }

    /// When the next piece is due.
    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.idle
    }
}

/// Whether a front end streams the body of a request on `route` with `content_type`: a
/// multipart form to an engine route. Front ends read such a body whole when it ends within
/// [`MULTIPART_WINDOW`](crate::openai::engine_model::MULTIPART_WINDOW).
pub(crate) fn streams(route: Route, content_type: Option<&[u8]>) -> bool {
    matches!(route, Route::Engine(_))
        && content_type.is_some_and(|value| {
            let essence = value.split(|&byte| byte == b';').next().unwrap_or(value);
            essence
                .trim_ascii()
                .eq_ignore_ascii_case(b"multipart/form-data")
        })
}

/// Why a piece of a streamed body could not be read from the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PieceError {
    /// No piece within the client timeout.
    Timeout,
    /// The body went past the size limit (the limit).
    TooLarge(u64),
    /// The chunked body breaks RFC 9112's grammar.
    Malformed,
    /// The client closed the connection.
    Gone,
}

impl From<PieceError> for Stop {
    fn from(error: PieceError) -> Self {
        match error {
            PieceError::Timeout => Stop::Answer(ApiError::RequestTimeout),
            PieceError::TooLarge(limit) => Stop::Answer(ApiError::BodyTooLarge { limit }),
            PieceError::Malformed => Stop::Answer(ApiError::InvalidFraming(
                kvmesh_h1::strict::Violation::Chunk,
            )),
            PieceError::Gone => Stop::ClientGone,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::route::{EngineRoutes, RouteMatch, match_route};
    use http::Method;

    #[test]
    fn only_multipart_forms_to_engine_routes_stream() {
        let routes = EngineRoutes::new(&kvmesh_config::EngineRoutesConfig::default());
        let route = |path| match match_route(&routes, &Method::POST, path) {
            RouteMatch::Found(route) => route,
            _ => panic!("{path} is served"),
        };
        let audio = route("/v1/audio/transcriptions");
        assert!(streams(audio, Some(b"multipart/form-data; boundary=x")));
        assert!(streams(audio, Some(b" Multipart/Form-Data ;boundary=x")));
        assert!(!streams(audio, Some(b"application/json")));
        assert!(!streams(audio, None));
        assert!(!streams(
            route("/v1/chat/completions"),
            Some(b"multipart/form-data")
        ));
    }
}

//! Reading a request through the gateway, message by message: its headers (with the body
//! modes and the subset hint of the stream's first message), then its body as the gateway's
//! body mode sends it. The picker's exchange feeds it the messages of one `ext_proc` stream
//! and answers what it must meanwhile ([`RequestReader::awaits_headers_answer`]).

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;

use crate::ext_proc::messages::{BodyMode, Modes, header, metadata_list};

/// A request as the gateway showed it.
#[derive(Debug)]
pub struct Seen {
    headers: Option<HeaderMap>,
    /// Its body (`None`: it has none, or the gateway sends none).
    pub body: Option<Bytes>,
    /// The stream's body modes.
    pub modes: Modes,
    /// The endpoints the gateway allows (`None`: any of the model's).
    pub subset: Option<Vec<String>>,
    /// Trailers ended the body; they await their answer.
    pub trailers: bool,
}

impl Seen {
    /// The request's header `name` (lowercase; `:path` and the other pseudo-headers too).
    pub fn header(&self, name: &str) -> Option<&str> {
        header(self.headers.as_ref(), name)
    }
}

/// A message that breaks the protocol: the stream ends with a gRPC status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProtocolError {
    /// A message where another was due (`INVALID_ARGUMENT`); what was due.
    Unexpected(&'static str),
    /// A request body mode the picker cannot serve (`FAILED_PRECONDITION`).
    UnsupportedMode,
}

impl ProtocolError {
    /// The `reason` it is counted under.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Unexpected(_) => "unexpected",
            Self::UnsupportedMode => "unsupported_mode",
        }
    }

    /// The status message.
    pub fn message(self) -> &'static str {
        match self {
            Self::Unexpected(message) => message,
            Self::UnsupportedMode => {
                "the endpoint picker needs the whole request body before the headers go \
                 upstream: set request_body_mode FULL_DUPLEX_STREAMED (the Inference \
                 Extension's) or BUFFERED"
            }
        }
    }
}

/// Why no request could be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unread {
    /// The body passed the limit.
    TooLarge,
    /// The gateway broke the protocol.
    Protocol(ProtocolError),
}

/// What the stream's first message started.
#[derive(Debug)]
pub enum Started {
    /// The whole request: it has no body, or the gateway sends none.
    Read(Seen),
    /// A request whose body follows.
    Body(RequestReader),
}

/// A request whose body is being read.
#[derive(Debug)]
pub struct RequestReader {
    seen: Seen,
    body: BytesMut,
    max_body_bytes: u64,
}

impl RequestReader {
    /// Reads the stream's `first` message: the request headers. The subset hint is the list
    /// at `subset_namespace` → `subset_key` of its metadata; a body longer than
    /// `max_body_bytes` will not be read.
    pub fn start(
        first: ProcessingRequest,
        subset_namespace: &str,
        subset_key: &str,
        max_body_bytes: u64,
    ) -> Result<Started, Unread> {
        let Some(Request::RequestHeaders(headers)) = first.request else {
            return Err(Unread::Protocol(ProtocolError::Unexpected(
                "the first message must carry the request headers",
            )));
        };
        let modes = Modes::of(first.protocol_config.as_ref());
        let subset = metadata_list(
            first.metadata_context.as_ref(),
            subset_namespace,
            subset_key,
        );
        let seen = Seen {
            headers: headers.headers,
            body: None,
            modes,
            subset,
            trailers: false,
        };
        if headers.end_of_stream {
            return Ok(Started::Read(seen));
        }
        match modes.request {
            BodyMode::None => Ok(Started::Read(seen)),
            BodyMode::FullDuplex | BodyMode::Buffered => Ok(Started::Body(Self {
                seen,
                body: BytesMut::new(),
                max_body_bytes,
            })),
            BodyMode::Streamed => Err(Unread::Protocol(ProtocolError::UnsupportedMode)),
        }
    }

    /// Whether the headers must be answered (unchanged) before the gateway sends the body:
    /// with a buffered body it waits for that.
    pub fn awaits_headers_answer(&self) -> bool {
        self.seen.modes.request == BodyMode::Buffered
    }

    /// Reads the next `message`: a piece of the body, or trailers. `true` once the body
    /// ended: the request is [`RequestReader::into_seen`].
    pub fn push(&mut self, message: ProcessingRequest) -> Result<bool, Unread> {
        match message.request {
            Some(Request::RequestBody(chunk)) => {
                if (self.body.len() + chunk.body.len()) as u64 > self.max_body_bytes {
                    return Err(Unread::TooLarge);
                }
                self.body.extend_from_slice(&chunk.body);
                Ok(chunk.end_of_stream)
            }
            Some(Request::RequestTrailers(_)) => {
                self.seen.trailers = true;
                Ok(true)
            }
            _ => Err(Unread::Protocol(ProtocolError::Unexpected(
                "expected the request body or its trailers",
            ))),
        }
    }

    /// The request with the body read so far.
    pub fn into_seen(self) -> Seen {
        Seen {
            body: Some(self.body.freeze()),
            ..self.seen
        }
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::{HeaderValue, Metadata};
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpBody, HttpHeaders, HttpTrailers, ProtocolConfiguration,
    };
    use envoy_types::pb::google::protobuf::{Struct, Value, value};

    use super::*;

    const LIMIT: u64 = 10;

    fn headers(mode: Option<BodySendMode>, end_of_stream: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![HeaderValue {
                        key: ":path".to_string(),
                        value: String::new(),
                        raw_value: b"/v1/completions".to_vec(),
                    }],
                }),
                end_of_stream,
                ..HttpHeaders::default()
            })),
            protocol_config: mode.map(|mode| ProtocolConfiguration {
                request_body_mode: mode as i32,
                ..ProtocolConfiguration::default()
            }),
            metadata_context: Some(Metadata {
                filter_metadata: [(
                    "ns".to_string(),
                    Struct {
                        fields: [(
                            "subset".to_string(),
                            Value {
                                kind: Some(value::Kind::StringValue("a:1, b:2".to_string())),
                            },
                        )]
                        .into(),
                    },
                )]
                .into(),
                ..Metadata::default()
            }),
            ..ProcessingRequest::default()
        }
    }

    fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(Request::RequestBody(HttpBody {
                body: bytes.to_vec(),
                end_of_stream,
                ..HttpBody::default()
            })),
            ..ProcessingRequest::default()
        }
    }

    fn start(first: ProcessingRequest) -> Result<Started, Unread> {
        RequestReader::start(first, "ns", "subset", LIMIT)
    }

    fn reader(first: ProcessingRequest) -> RequestReader {
        match start(first) {
            Ok(Started::Body(reader)) => reader,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_request_without_a_body_is_read_from_its_headers() {
        let Ok(Started::Read(seen)) = start(headers(None, true)) else {
            panic!("read");
        };
        assert_eq!(seen.header(":path"), Some("/v1/completions"));
        assert_eq!(
            seen.subset,
            Some(vec!["a:1".to_string(), "b:2".to_string()])
        );
        assert_eq!((seen.body, seen.trailers), (None, false));
        let Ok(Started::Read(seen)) = start(headers(Some(BodySendMode::None), false)) else {
            panic!("no body sent");
        };
        assert_eq!(seen.body, None);
    }

    #[test]
    fn a_full_duplex_body_is_joined_from_its_pieces() {
        let mut reader = reader(headers(None, false));
        assert!(!reader.awaits_headers_answer());
        assert_eq!(reader.push(body(b"{\"a\"", false)), Ok(false));
        assert_eq!(reader.push(body(b":1}", true)), Ok(true));
        let seen = reader.into_seen();
        assert_eq!(seen.body.as_deref(), Some(&b"{\"a\":1}"[..]));
        assert!(!seen.trailers);
    }

    #[test]
    fn a_buffered_body_waits_for_the_headers_answer_and_trailers_end_it() {
        let mut reader = reader(headers(Some(BodySendMode::Buffered), false));
        assert!(reader.awaits_headers_answer());
        assert_eq!(reader.push(body(b"{}", false)), Ok(false));
        let trailers = ProcessingRequest {
            request: Some(Request::RequestTrailers(HttpTrailers::default())),
            ..ProcessingRequest::default()
        };
        assert_eq!(reader.push(trailers), Ok(true));
        let seen = reader.into_seen();
        assert_eq!(
            (seen.body.as_deref(), seen.trailers),
            (Some(&b"{}"[..]), true)
        );
    }

    #[test]
    fn a_body_over_the_limit_is_refused() {
        let mut reader = reader(headers(None, false));
        assert_eq!(reader.push(body(&[b'x'; 6], false)), Ok(false));
        assert_eq!(reader.push(body(&[b'x'; 4], false)), Ok(false));
        assert_eq!(reader.push(body(b"x", true)), Err(Unread::TooLarge));
    }

    #[test]
    fn messages_out_of_order_and_streamed_bodies_break_the_protocol() {
        let error = start(body(b"{}", true)).unwrap_err();
        assert_eq!(
            error,
            Unread::Protocol(ProtocolError::Unexpected(
                "the first message must carry the request headers"
            ))
        );
        let Unread::Protocol(unsupported) =
            start(headers(Some(BodySendMode::Streamed), false)).unwrap_err()
        else {
            panic!("not a protocol error");
        };
        assert_eq!(unsupported.reason(), "unsupported_mode");
        assert!(unsupported.message().contains("FULL_DUPLEX_STREAMED"));
        let mut reader = reader(headers(None, false));
        let Err(Unread::Protocol(unexpected)) = reader.push(headers(None, false)) else {
            panic!("headers twice");
        };
        assert_eq!(unexpected.reason(), "unexpected");
    }
}

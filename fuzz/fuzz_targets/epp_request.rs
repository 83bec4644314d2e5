//! One `ext_proc` stream as the endpoint picker reads it (`kvmesh_wire::ext_proc`): the
//! gateway's `ProcessingRequest`s decoded from their gRPC frames (prost), the request read
//! from them (`RequestReader`: headers, body modes and subset hint, then the body as its mode
//! sends it), the headers and metadata the picker looks up, and the answers it builds.
//!
//! Input: gRPC length-prefixed messages (a flag byte 0, a 4-byte big-endian length, the
//! message), as the gateway writes them; the stream ends where a frame or a message does not
//! decode. Whatever they hold: nothing panics; a request that is read has the first
//! message's modes and headers (found whatever the case of their names), a body exactly the
//! body pieces that came, within the limit, and trailers only when they ended it; one that is
//! refused is refused for what came (a body past the limit, a message out of order, a
//! streamed body mode); a subset hint written as a string is a list of trimmed endpoints that
//! reads back from its comma-joined form; and every answer built encodes and decodes to
//! itself.

#![no_main]

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use envoy_types::pb::google::protobuf::value;
use kvmesh_wire::ext_proc::messages::{
    BodyMode, Half, Modes, body_answer, header, headers_answer, immediate, metadata_list,
    metadata_string, pick_metadata, set_header, split_endpoints, trailers_answer,
};
use kvmesh_wire::ext_proc::request::{ProtocolError, RequestReader, Seen, Started, Unread};
use libfuzzer_sys::fuzz_target;
use prost::Message;

/// The subset hint's namespace and key, and the picker's own, as `epp` configures them by
/// default.
const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
const NAMESPACE: &str = "envoy.lb";
const DESTINATION: &str = "x-gateway-destination-endpoint";
const SERVED: &str = "x-gateway-destination-endpoint-served";
/// `limits.max_body_bytes`, small enough to be reached.
const LIMIT: u64 = 256;

/// The messages of `data`, up to the first frame or message that does not decode.
fn messages(mut data: &[u8]) -> impl Iterator<Item = ProcessingRequest> {
    std::iter::from_fn(move || {
        let (&[flag, a, b, c, d], rest) = data.split_first_chunk::<5>()?;
        let length = u32::from_be_bytes([a, b, c, d]) as usize;
        if flag != 0 || rest.len() < length {
            return None;
        }
        let (message, rest) = rest.split_at(length);
        data = rest;
        ProcessingRequest::decode(message).ok()
    })
}

/// An answer encodes and decodes to itself.
fn round_trips(answer: &ProcessingResponse) {
    let again = ProcessingResponse::decode(answer.encode_to_vec().as_slice());
    assert_eq!(again.as_ref(), Ok(answer));
}

/// What the picker looks up in any message: its headers (as the response half reads the
/// content type) and the served endpoint.
fn look_up(message: &ProcessingRequest) {
    let headers = match &message.request {
        Some(Request::RequestHeaders(headers) | Request::ResponseHeaders(headers)) => {
            headers.headers.as_ref()
        }
        _ => None,
    };
    check_headers(headers, |name| header(headers, name));
    metadata_string(message.metadata_context.as_ref(), NAMESPACE, SERVED);
}

/// Every header of `map` is found by `lookup` whatever the case of its name asked.
fn check_headers<'h>(map: Option<&HeaderMap>, lookup: impl Fn(&str) -> Option<&'h str>) {
    for entry in map.iter().flat_map(|map| &map.headers) {
        let found = lookup(&entry.key);
        assert_eq!(lookup(&entry.key.to_ascii_uppercase()), found);
        assert_eq!(lookup(&entry.key.to_ascii_lowercase()), found);
    }
}

/// What holds of a request read from `first` (and `body`, the body pieces that came).
fn check_seen(seen: &Seen, first: &ProcessingRequest, body: Option<&[u8]>) {
    assert_eq!(seen.modes, Modes::of(first.protocol_config.as_ref()));
    let Some(Request::RequestHeaders(headers)) = &first.request else {
        panic!("read without request headers first");
    };
    check_headers(headers.headers.as_ref(), |name| seen.header(name));
    assert_eq!(seen.body.as_deref(), body);
    assert!(
        seen.body
            .as_ref()
            .is_none_or(|body| body.len() as u64 <= LIMIT)
    );
    assert_eq!(
        seen.subset,
        metadata_list(
            first.metadata_context.as_ref(),
            SUBSET_NAMESPACE,
            SUBSET_KEY
        )
    );
    let hint = first
        .metadata_context
        .as_ref()
        .and_then(|metadata| metadata.filter_metadata.get(SUBSET_NAMESPACE))
        .and_then(|hint| hint.fields.get(SUBSET_KEY))
        .and_then(|value| value.kind.as_ref());
    if let (Some(value::Kind::StringValue(_)), Some(subset)) = (hint, &seen.subset) {
        for endpoint in subset {
            assert!(!endpoint.is_empty() && endpoint.trim() == endpoint && !endpoint.contains(','));
        }
        assert_eq!(&split_endpoints(&subset.join(",")), subset);
    }
    // The answers naming a pick, as the exchange sends them.
    let endpoints = seen.header(":authority").unwrap_or("10.0.0.1:8000");
    let set = || vec![set_header(DESTINATION, endpoints.as_bytes())];
    let metadata = || Some(pick_metadata(NAMESPACE, DESTINATION, endpoints));
    round_trips(&headers_answer(Half::Request, set(), metadata()));
    if let Some(body) = &seen.body {
        let echo = Some((body.to_vec(), !seen.trailers));
        round_trips(&body_answer(Half::Request, echo, Vec::new(), None));
        round_trips(&body_answer(Half::Request, None, set(), metadata()));
    }
    round_trips(&trailers_answer(Half::Response));
    let refusal = Bytes::from(endpoints.as_bytes().to_vec());
    round_trips(&immediate(429, refusal, Some(2)));
}

fuzz_target!(|data: &[u8]| {
    let mut stream = messages(data);
    let Some(first) = stream.next() else {
        return;
    };
    look_up(&first);
    let started = RequestReader::start(first.clone(), SUBSET_NAMESPACE, SUBSET_KEY, LIMIT);
    let mut reader = match started {
        Ok(Started::Read(seen)) => return check_seen(&seen, &first, None),
        Ok(Started::Body(reader)) => reader,
        Err(Unread::Protocol(ProtocolError::Unexpected(_))) => {
            assert!(!matches!(first.request, Some(Request::RequestHeaders(_))));
            return;
        }
        Err(Unread::Protocol(ProtocolError::UnsupportedMode)) => {
            let modes = Modes::of(first.protocol_config.as_ref());
            assert_eq!(modes.request, BodyMode::Streamed);
            return;
        }
        Err(Unread::TooLarge) => panic!("too large before a body"),
    };
    let mut body = Vec::new();
    for message in stream {
        look_up(&message);
        let piece = match &message.request {
            Some(Request::RequestBody(piece)) => Some(piece.body.clone()),
            _ => None,
        };
        let trailers = matches!(message.request, Some(Request::RequestTrailers(_)));
        match reader.push(message) {
            Ok(ended) => {
                assert!(piece.is_some() || trailers, "read a body piece or trailers");
                body.extend(piece.unwrap_or_default());
                if ended {
                    let seen = reader.into_seen();
                    assert_eq!(seen.trailers, trailers);
                    return check_seen(&seen, &first, Some(&body));
                }
            }
            Err(Unread::TooLarge) => {
                let piece = piece.expect("only a body piece is too large");
                assert!((body.len() + piece.len()) as u64 > LIMIT);
                return;
            }
            Err(Unread::Protocol(ProtocolError::Unexpected(_))) => {
                assert!(piece.is_none() && !trailers);
                return;
            }
            Err(Unread::Protocol(ProtocolError::UnsupportedMode)) => {
                panic!("the mode is read once, from the first message")
            }
        }
    }
});

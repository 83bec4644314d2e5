//! Reading a request through the gateway (phase 1 of [`crate::frontend::epp::exchange`]): its headers
//! (with the body modes and the subset hint of the stream's first message), then its body
//! as the gateway's body mode sends it.

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use tonic::Status;

use crate::frontend::epp::messages::{
    BodyMode, Half, Modes, header, headers_answer, metadata_list,
};
use crate::frontend::epp::settings::Settings;
use crate::frontend::epp::wire::Wire;

/// A request as the gateway showed it.
#[derive(Debug)]
pub(crate) struct Seen {
    headers: Option<HeaderMap>,
    /// Its body (`None`: it has none, or the gateway sends none).
    pub(crate) body: Option<Bytes>,
    /// The stream's body modes.
    pub(crate) modes: Modes,
    /// The endpoints the gateway allows (`None`: any of the model's).
    pub(crate) subset: Option<Vec<String>>,
    /// Trailers ended the body; they await their answer.
    pub(crate) trailers: bool,
}

impl Seen {
    /// The request's header `name` (lowercase; `:path` and the other pseudo-headers too).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        header(self.headers.as_ref(), name)
    }
}

/// Why no request could be read.
#[derive(Debug)]
pub(crate) enum Unread {
    /// The gateway closed the stream.
    Gone,
    /// The body passed `limits.max_body_bytes`.
    TooLarge,
    /// A protocol error, ending the stream with this status (counted under `reason`).
    Protocol(&'static str, Status),
}

/// Reads the request's headers and body from `wire`. With a buffered body the headers are
/// answered (unchanged) first, as the gateway waits for that before sending the body.
pub(crate) async fn read_request(
    wire: &mut Wire,
    settings: &Settings,
    max_body_bytes: u64,
) -> Result<Seen, Unread> {
    let first = wire.next().await.ok_or(Unread::Gone)?;
    let Some(Request::RequestHeaders(headers)) = first.request else {
        return Err(unexpected(
            "the first message must carry the request headers",
        ));
    };
    let modes = Modes::of(first.protocol_config.as_ref());
    let subset = metadata_list(
        first.metadata_context.as_ref(),
        &settings.subset_namespace,
        &settings.subset_key,
    );
    let mut seen = Seen {
        headers: headers.headers,
        body: None,
        modes,
        subset,
        trailers: false,
    };
    if headers.end_of_stream {
        return Ok(seen);
    }
    match modes.request {
        BodyMode::None => return Ok(seen),
        BodyMode::FullDuplex => {}
        BodyMode::Buffered => {
            if !wire
                .send(headers_answer(Half::Request, Vec::new(), None))
                .await
            {
                return Err(Unread::Gone);
            }
        }
        BodyMode::Streamed => {
            return Err(Unread::Protocol(
                "unsupported_mode",
                Status::failed_precondition(
                    "the endpoint picker needs the whole request body before the headers go \
                     upstream: set request_body_mode FULL_DUPLEX_STREAMED (the Inference \
                     Extension's) or BUFFERED",
                ),
            ));
        }
    }
    let mut body = BytesMut::new();
    loop {
        match wire.next().await.ok_or(Unread::Gone)?.request {
            Some(Request::RequestBody(chunk)) => {
                if (body.len() + chunk.body.len()) as u64 > max_body_bytes {
                    return Err(Unread::TooLarge);
                }
                body.extend_from_slice(&chunk.body);
                if chunk.end_of_stream {
                    break;
                }
            }
            Some(Request::RequestTrailers(_)) => {
                seen.trailers = true;
                break;
            }
            _ => return Err(unexpected("expected the request body or its trailers")),
        }
    }
    seen.body = Some(body.freeze());
    Ok(seen)
}

fn unexpected(message: &'static str) -> Unread {
    Unread::Protocol("unexpected", Status::invalid_argument(message))
}

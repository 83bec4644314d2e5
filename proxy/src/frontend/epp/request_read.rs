//! Reading a request through the gateway (phase 1 of [`crate::frontend::epp::exchange`]): the
//! stream's messages fed to [`RequestReader`] (its headers, with the body modes and the
//! subset hint of the stream's first message, then its body as the gateway's body mode sends
//! it), and the headers answered when the gateway waits for that.

use kvmesh_wire::ext_proc::messages::{Half, headers_answer};
use kvmesh_wire::ext_proc::request::{self, RequestReader, Seen, Started};
use tonic::Status;

use crate::frontend::epp::settings::Settings;
use crate::frontend::epp::wire::Wire;

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

impl From<request::Unread> for Unread {
    fn from(unread: request::Unread) -> Self {
        match unread {
            request::Unread::TooLarge => Self::TooLarge,
            request::Unread::Protocol(error) => {
                let status = match error {
                    request::ProtocolError::Unexpected(message) => {
                        Status::invalid_argument(message)
                    }
                    request::ProtocolError::UnsupportedMode => {
                        Status::failed_precondition(error.message())
                    }
                };
                Self::Protocol(error.reason(), status)
            }
        }
    }
}

/// Reads the request's headers and body from `wire`. With a buffered body the headers are
/// answered (unchanged) first, as the gateway waits for that before sending the body.
pub(crate) async fn read_request(
    wire: &mut Wire,
    settings: &Settings,
    max_body_bytes: u64,
) -> Result<Seen, Unread> {
    let first = wire.next().await.ok_or(Unread::Gone)?;
    let started = RequestReader::start(
        first,
        &settings.subset_namespace,
        &settings.subset_key,
        max_body_bytes,
    )?;
    let mut reader = match started {
        Started::Read(seen) => return Ok(seen),
        Started::Body(reader) => reader,
    };
    if reader.awaits_headers_answer()
        && !wire
            .send(headers_answer(Half::Request, Vec::new(), None))
            .await
    {
        return Err(Unread::Gone);
    }
    loop {
        let message = wire.next().await.ok_or(Unread::Gone)?;
        if reader.push(message)? {
            return Ok(reader.into_seen());
        }
    }
}

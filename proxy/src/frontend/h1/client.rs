//! The client side of a request on the fast path: its parsed head, the connection, and the
//! response written back with as few writes as the framing allows (head and body together
//! when the engine's whole answer is already here).

use std::future::poll_fn;
use std::io::IoSlice;
use std::task::{Poll, ready};

use bytes::{Bytes, BytesMut};
use http::header::HeaderName;
use http::{HeaderValue, Method};
use kvmesh_h1::body::{Decoded, Framing};
use kvmesh_h1::digits::{push_decimal, push_hex};
use kvmesh_h1::fields::is_end_to_end;
use kvmesh_h1::head::{Known, RequestHead};
use kvmesh_telemetry::traceparent::is_trace_field;
use pingora_http::RequestHeader;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{Instant, timeout_at};

use super::io::{ClientIo, READ_RESERVE};
use super::response::{write_error, write_relayed_head};
use crate::engines::upstream_session::UpstreamSession;
use crate::metrics::families::Metrics;
use crate::openai::api_error::ApiError;
use crate::openai::engine_model::MULTIPART_WINDOW;
use crate::openai::headers::{
    ClientFraming, EngineHead, EngineTarget, InvalidHead, ProxyHeaders, X_DATA_PARALLEL_RANK,
    X_REQUEST_ID, upstream_request,
};
use crate::request::body::{BodyRest, PieceError, RequestBody, StreamedRead};
use crate::request::frontend::{Frontend, Unrelayable};
use crate::request::record::Record;

/// Bytes a client may send ahead (pipelined) while its request is served.
const MAX_READ_AHEAD: usize = 1 << 20;

/// Why a request body could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyRead {
    /// The deadline passed.
    Timeout,
    /// The client closed the connection.
    Gone,
    /// The body is (or was announced, by its length or a chunk's size) over the limit.
    TooLarge,
    /// The chunked body breaks RFC 9112's grammar.
    Malformed,
}

/// One request's client on the fast path, over `S` (TCP or TLS).
pub(crate) struct FastConnection<'a, S> {
    io: &'a mut S,
    /// Bytes read from the client and not yet consumed.
    buf: &'a mut BytesMut,
    /// Response bytes not yet written.
    out: &'a mut Vec<u8>,
    head: &'a RequestHead,
    /// The `Authorization` field is the gateway's (an API key): engines never see it.
    pub(crate) strip_authorization: bool,
    /// The connection closes after this response.
    pub(crate) close: bool,
    /// The whole request body was read.
    pub(crate) body_read: bool,
    /// The response body is chunk-encoded.
    chunked: bool,
    /// The request body streams: what is left of it to read.
    streaming: Option<Streaming>,
}

/// What is left to read of a streamed request body.
#[derive(Debug)]
struct Streaming {
    /// The rest's framing, as far as it is decoded.
    framing: Framing,
    /// How far it is read.
    read: StreamedRead,
}

impl<'a, S: ClientIo> FastConnection<'a, S> {
    /// The client of `head`, read from `io` (with `buf` read ahead).
    pub(crate) fn new(
        io: &'a mut S,
        buf: &'a mut BytesMut,
        out: &'a mut Vec<u8>,
        head: &'a RequestHead,
        close: bool,
    ) -> Self {
        Self {
            io,
            buf,
            out,
            head,
            strip_authorization: false,
            close,
            body_read: false,
            chunked: false,
            streaming: None,
        }
    }

    /// Reads the body framed by `framing` (a length, or chunked), of at most `limit` bytes,
    /// by `deadline`. A body announced over the limit is refused before it is read. A body
    /// that `streams` longer than [`MULTIPART_WINDOW`] is read only that far: the spine reads
    /// the rest ([`Frontend::read_body_piece`]), each piece within `idle`.
    pub(crate) async fn read_body(
        &mut self,
        mut framing: Framing,
        (limit, idle): (u64, Duration),
        deadline: Instant,
        streams: bool,
    ) -> Result<RequestBody, BodyRead> {
        if framing.announced() > limit {
            return Err(BodyRead::TooLarge);
        }
        let window = if streams {
            MULTIPART_WINDOW
        } else {
            usize::MAX
        };
        if let Framing::Length(length) = framing {
            let length = usize::try_from(length).map_err(|_| BodyRead::TooLarge)?;
            while self.buf.len() < length.min(window) {
                self.buf.reserve(length.min(window) - self.buf.len());
                self.read_within(deadline).await?;
            }
            let start = self.buf.split_to(self.buf.len().min(length)).freeze();
            if start.len() == length {
                self.body_read = true;
                return Ok(RequestBody::whole(start));
            }
            self.streaming = Some(Streaming {
                framing: Framing::Length((length - start.len()) as u64),
                read: StreamedRead::new(start.len() as u64, limit, idle),
            });
            let rest = BodyRest::new(Some(length as u64));
            return Ok(RequestBody {
                read: start,
                rest: Some(rest),
            });
        }
        let mut body = BytesMut::new();
        loop {
            let decoded = framing
                .decode(self.buf, false)
                .map_err(|_| BodyRead::Malformed)?;
            if let Decoded::Data(data) = &decoded {
                body.extend_from_slice(data);
            }
            // A chunk announced over the limit is refused before its data is waited for.
            if (body.len() as u64).saturating_add(framing.announced()) > limit {
                return Err(BodyRead::TooLarge);
            }
            match decoded {
                Decoded::Data(_) if body.len() >= window => break,
                Decoded::Data(_) => {}
                Decoded::End => {
                    self.body_read = true;
                    return Ok(RequestBody::whole(body.freeze()));
                }
                Decoded::NeedMore => {
                    self.buf.reserve(READ_RESERVE);
                    self.read_within(deadline).await?;
                }
            }
        }
        self.streaming = Some(Streaming {
            framing,
            read: StreamedRead::new(body.len() as u64, limit, idle),
        });
        Ok(RequestBody {
            read: body.freeze(),
            rest: Some(BodyRest::new(None)),
        })
    }

    /// The next piece of a streamed body, decoded from what is read (and read within the
    /// wait allowed); `None` at its end. On an error the connection is to close.
    async fn next_piece(&mut self) -> Result<Option<Bytes>, PieceError> {
        let Some(streaming) = self.streaming.as_mut() else {
            return Ok(None);
        };
        loop {
            let decoded = streaming
                .framing
                .decode(self.buf, false)
                .map_err(|_| PieceError::Malformed)?;
            let piece = match decoded {
                Decoded::Data(data) => Some(data),
                Decoded::End => None,
                Decoded::NeedMore => {
                    streaming.read.check(streaming.framing.announced())?;
                    self.buf.reserve(READ_RESERVE);
                    let until = streaming.read.deadline();
                    match timeout_at(until, self.io.read_buf(self.buf)).await {
                        Err(_) => return Err(PieceError::Timeout),
                        Ok(Ok(0) | Err(_)) => return Err(PieceError::Gone),
                        Ok(Ok(_)) => continue,
                    }
                }
            };
            let Some(piece) = piece else {
                self.streaming = None;
                self.body_read = true;
                return Ok(None);
            };
            streaming.read.count(piece.len())?;
            return Ok(Some(piece));
        }
    }

    /// Reads more of the request by `deadline`.
    async fn read_within(&mut self, deadline: Instant) -> Result<(), BodyRead> {
        match timeout_at(deadline, self.io.read_buf(self.buf)).await {
            Err(_) => Err(BodyRead::Timeout),
            Ok(Ok(0) | Err(_)) => Err(BodyRead::Gone),
            Ok(Ok(_)) => Ok(()),
        }
    }

    /// Tells a client that sent `Expect: 100-continue` to send its body; `false` when it is
    /// gone.
    pub(crate) async fn write_continue(&mut self) -> bool {
        write_all(self.io, [b"HTTP/1.1 100 Continue\r\n\r\n", b"", b""]).await
    }

    /// Writes what is pending; `false` when the client is gone.
    async fn flush(&mut self) -> bool {
        let written = write_all(self.io, [self.out.as_slice(), b"", b""]).await;
        self.out.clear();
        written
    }

    /// Whether a client field is passed on to the engine.
    fn forwards(&self, name: &[u8]) -> bool {
        let ours = name.eq_ignore_ascii_case(b"host")
            || name.eq_ignore_ascii_case(b"content-length")
            || name.eq_ignore_ascii_case(X_REQUEST_ID.as_str().as_bytes())
            || (self.strip_authorization && name.eq_ignore_ascii_case(b"authorization"));
        // The fast path serves heads with at most one `Connection` field.
        let connection = self.head.fields.get(Known::Connection);
        !ours && is_end_to_end(name, connection)
    }
}

impl<S: ClientIo> Frontend for FastConnection<'_, S> {
    fn engine_request(&self, target: &EngineTarget<'_>) -> Result<EngineHead, InvalidHead> {
        let invalid = |error: Box<pingora_error::Error>| InvalidHead(error.to_string());
        let mut client = RequestHeader::build(
            Method::POST,
            self.head.origin_form(),
            Some(self.head.fields.len()),
        )
        .map_err(invalid)?;
        for (name, value) in self.head.fields.iter() {
            if !self.forwards(name) {
                continue;
            }
            if let (Ok(name), Ok(value)) =
                (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
            {
                client.append_header(name, value).map_err(invalid)?;
            }
        }
        Ok(upstream_request(&client, target))
    }

    fn header(&self, name: &str) -> Option<&str> {
        let (_, value) = self
            .head
            .fields
            .iter()
            .find(|(field, _)| field.eq_ignore_ascii_case(name.as_bytes()))?;
        std::str::from_utf8(value).ok()
    }

    fn query(&self) -> Option<&str> {
        let target = self.head.origin_form();
        let start = target.iter().position(|&byte| byte == b'?')? + 1;
        // httparse accepts only visible ASCII in the target.
        std::str::from_utf8(&target[start..]).ok()
    }

    fn write_engine_request(
        &self,
        target: &EngineTarget<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), InvalidHead> {
        out.extend_from_slice(self.head.method());
        out.push(b' ');
        out.extend_from_slice(self.head.origin_form());
        out.extend_from_slice(b" HTTP/1.1\r\n");
        for (name, value) in self.head.fields.iter() {
            let ours = (target.trace.is_some() && is_trace_field(name))
                || (target.dp_rank.is_some()
                    && name.eq_ignore_ascii_case(X_DATA_PARALLEL_RANK.as_bytes()));
            if self.forwards(name) && !ours {
                out.extend_from_slice(name);
                out.extend_from_slice(b": ");
                out.extend_from_slice(value);
                out.extend_from_slice(b"\r\n");
            }
        }
        out.extend_from_slice(b"host: ");
        out.extend_from_slice(target.host.as_bytes());
        match target.body_len {
            Some(length) => {
                out.extend_from_slice(b"\r\ncontent-length: ");
                push_decimal(out, length as usize);
            }
            None => out.extend_from_slice(b"\r\ntransfer-encoding: chunked"),
        }
        out.extend_from_slice(b"\r\nx-request-id: ");
        out.extend_from_slice(target.request_id.as_bytes());
        for (name, value) in target.trace.iter().flat_map(|trace| trace.fields()) {
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
        }
        if let Some(rank) = target.dp_rank {
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(X_DATA_PARALLEL_RANK.as_bytes());
            out.extend_from_slice(b": ");
            push_decimal(out, rank as usize);
        }
        out.extend_from_slice(b"\r\n\r\n");
        Ok(())
    }

    async fn read_body_piece(&mut self) -> Result<Option<Bytes>, PieceError> {
        let piece = self.next_piece().await;
        self.close |= piece.is_err();
        piece
    }

    async fn gone(&mut self) {
        if self.streaming.is_some() {
            // The client is still sending the body the spine reads.
            return std::future::pending().await;
        }
        // Nothing else reads the client while a request is served: what it sends ahead is
        // kept for the next request, up to a bound.
        poll_fn(|cx| {
            loop {
                match ready!(self.io.poll_read_ahead(cx, self.buf)) {
                    Ok(0) | Err(_) => return Poll::Ready(()),
                    Ok(_) if self.buf.len() > MAX_READ_AHEAD => return Poll::Ready(()),
                    Ok(_) => {}
                }
            }
        })
        .await;
    }

    async fn reject(&mut self, record: &mut Record, metrics: &Metrics, error: &ApiError) -> bool {
        // The rest of a streamed body is unread: nothing after it can be read as a request.
        self.close |= self.streaming.is_some();
        record.answered_with(metrics, error);
        write_error(self.out, error, &record.request_id, self.close);
        let written = self.flush().await;
        record.client_gone |= !written;
        written && !self.close
    }

    /// Writes the head into the output buffer; it leaves at once unless the body is
    /// already here, which then goes with it in one write.
    async fn start_response(
        &mut self,
        engine: &UpstreamSession,
        ours: ProxyHeaders<'_>,
    ) -> Result<ClientFraming, Unrelayable> {
        let Some(framing) = write_relayed_head(self.out, engine, ours, self.close) else {
            self.out.clear();
            return Err(Unrelayable::EngineHead);
        };
        self.chunked = framing == ClientFraming::Open;
        if !engine.body_ready() && !self.flush().await {
            return Err(Unrelayable::ClientGone);
        }
        Ok(framing)
    }

    async fn write_body(&mut self, data: Bytes, end: bool) -> bool {
        let mut tail: &[u8] = b"";
        if self.chunked {
            if !data.is_empty() {
                push_hex(self.out, data.len());
                self.out.extend_from_slice(b"\r\n");
                tail = if end { b"\r\n0\r\n\r\n" } else { b"\r\n" };
            } else if end {
                tail = b"0\r\n\r\n";
            }
        }
        let written = write_all(self.io, [self.out.as_slice(), &data, tail]).await;
        self.out.clear();
        written
    }
}

/// Writes every byte of `parts`, in order, with vectored writes; `false` on failure.
async fn write_all<S: ClientIo>(io: &mut S, mut parts: [&[u8]; 3]) -> bool {
    loop {
        let Some(first) = parts.iter().position(|part| !part.is_empty()) else {
            return true;
        };
        let slices = parts.map(IoSlice::new);
        let written = match io.write_vectored(&slices[first..]).await {
            Ok(0) | Err(_) => return false,
            Ok(written) => written,
        };
        let mut left = written;
        for part in &mut parts[first..] {
            let taken = left.min(part.len());
            *part = &part[taken..];
            left -= taken;
        }
    }
}

//! The gRPC side of a forwarded request: the engine's OpenAI completion answer (JSON, or
//! server-sent events when streaming) becomes `ModelInferResponse`s, sent as they come
//! (streaming) or as one (folded); proxy errors and engine errors become a [`Failure`].

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use kvmesh_proto::inference::{ModelInferResponse, ModelStreamInferResponse};
use pingora_http::RequestHeader;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::Status;

use crate::api_error::ApiError;
use crate::auth::CompletionMeter;
use crate::downstream::{Downstream, UpstreamTarget};
use crate::exchange::Exchange;
use crate::failure::FailureKind;
use crate::forward::Answer;
use crate::grpc::engine_json::{error_message, parse_completion};
use crate::grpc::failure::Failure;
use crate::grpc::outputs::{Piece, Reply};
use crate::grpc::sse::{DONE, SseData};
use crate::headers::upstream_request;
use crate::kv_route::booking::Booking;
use crate::metrics::{Metrics, ModelMetrics};
use crate::pool::ModelPool;
use crate::relay::RelayEnd;
use crate::state::State;
use crate::token_timing::TokenTiming;
use crate::upstream_session::UpstreamSession;

/// Most bytes of an engine error body kept for the message.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// One item of a ModelStreamInfer response stream.
pub(crate) type StreamItem = Result<ModelStreamInferResponse, Status>;

/// Where the responses to one request go.
#[derive(Debug)]
pub(crate) enum Sink {
    /// ModelInfer: the one response, for the handler to return.
    Unary(Option<ModelInferResponse>),
    /// ModelStreamInfer: onto the stream the requests of one call share.
    Stream(mpsc::Sender<StreamItem>),
}

impl Sink {
    /// Sends `response`; `false` when the client is gone.
    async fn send(&mut self, response: ModelInferResponse) -> bool {
        match self {
            Self::Unary(slot) => {
                *slot = Some(response);
                true
            }
            Self::Stream(tx) => tx
                .send(Ok(ModelStreamInferResponse {
                    error_message: String::new(),
                    infer_response: Some(response),
                }))
                .await
                .is_ok(),
        }
    }

    /// Completes when the client is gone (a unary client's leaving drops the whole
    /// request instead, so then it never does).
    pub(crate) async fn closed(&self) {
        match self {
            Self::Unary(_) => std::future::pending().await,
            Self::Stream(tx) => tx.closed().await,
        }
    }

    /// The unary response, once sent.
    pub(crate) fn take_response(&mut self) -> Option<ModelInferResponse> {
        match self {
            Self::Unary(slot) => slot.take(),
            Self::Stream(_) => None,
        }
    }
}

/// What reading the engine's body gave.
enum Read {
    /// A chunk.
    Chunk(Bytes),
    /// The end of the body.
    Done,
    /// The engine broke off or stalled.
    Failed(FailureKind),
    /// The client left.
    Gone,
}

/// Reads the next chunk of the engine's body within `idle`, unless the client leaves.
async fn read(upstream: &mut UpstreamSession, sink: &Sink, idle: Duration) -> Read {
    tokio::select! {
        biased;
        read = upstream.read_body_within(idle) => match read {
            Err(_) => Read::Failed(FailureKind::Timeout),
            Ok(Err(_)) => Read::Failed(FailureKind::Reset),
            Ok(Ok(None)) => Read::Done,
            Ok(Ok(Some(chunk))) => Read::Chunk(chunk),
        },
        () = sink.closed() => Read::Gone,
    }
}

/// What the relay needs from the exchange.
struct Relay<'a> {
    started: Instant,
    idle: Duration,
    metrics: &'a ModelMetrics,
    prefill: Option<&'a Booking<'a>>,
    /// Charges the completion to the API key (a key with a tokens-per-minute limit).
    meter: Option<&'a CompletionMeter>,
}

impl Relay<'_> {
    /// A body chunk arrived: the request's prefill is over, and the completion so far is
    /// charged.
    fn chunk(&mut self, chunk: &[u8], event_stream: bool) {
        if let Some(booking) = self.prefill.take() {
            booking.prefill_done();
        }
        if let Some(meter) = self.meter {
            meter.observe(chunk, event_stream);
        }
    }
}

/// The gRPC client of one forwarded request.
pub(crate) struct GrpcDownstream<'a> {
    head: &'a RequestHeader,
    sink: &'a mut Sink,
    reply: &'a Reply,
    /// Send each generated chunk as it comes (else one folded response).
    deltas: bool,
    /// Largest engine answer (or streamed event) accepted.
    max_body_bytes: usize,
    failure: Option<Failure>,
}

impl<'a> GrpcDownstream<'a> {
    /// A client whose engine request is built from `head` and whose responses, shaped by
    /// `reply`, go to `sink`: one per generated chunk when `deltas`, else one.
    pub(crate) fn new(
        head: &'a RequestHeader,
        sink: &'a mut Sink,
        reply: &'a Reply,
        deltas: bool,
        max_body_bytes: usize,
    ) -> Self {
        Self {
            head,
            sink,
            reply,
            deltas,
            max_body_bytes,
            failure: None,
        }
    }

    /// Why the request failed, if it did.
    pub(crate) fn into_failure(self) -> Option<Failure> {
        self.failure
    }

    /// An engine error status: its message becomes the failure; the body is drained so
    /// the connection can be reused.
    async fn engine_error(
        &mut self,
        upstream: &mut UpstreamSession,
        status: u16,
        idle: Duration,
    ) -> RelayEnd {
        let mut body = BytesMut::new();
        loop {
            match read(upstream, self.sink, idle).await {
                Read::Chunk(chunk) => {
                    let room = MAX_ERROR_BODY.saturating_sub(body.len());
                    body.extend_from_slice(&chunk[..chunk.len().min(room)]);
                }
                Read::Done => break,
                Read::Failed(kind) => {
                    self.failure = Some(Failure::Engine {
                        status,
                        message: error_message(&body),
                    });
                    return RelayEnd::UpstreamFailed { kind, clean: true };
                }
                Read::Gone => return RelayEnd::ClientGone,
            }
        }
        self.failure = Some(Failure::Engine {
            status,
            message: error_message(&body),
        });
        RelayEnd::Complete
    }

    /// A whole (non-streamed) completion: one response.
    async fn relay_whole(
        &mut self,
        upstream: &mut UpstreamSession,
        mut relay: Relay<'_>,
    ) -> RelayEnd {
        let mut first: Option<Bytes> = None;
        let mut joined: Option<BytesMut> = None;
        let mut total = 0usize;
        loop {
            let chunk = match read(upstream, self.sink, relay.idle).await {
                Read::Chunk(chunk) => chunk,
                Read::Done => break,
                Read::Failed(kind) => return self.broke_off(kind),
                Read::Gone => return RelayEnd::ClientGone,
            };
            relay.chunk(&chunk, false);
            total = total.saturating_add(chunk.len());
            if total > self.max_body_bytes {
                // Drained and dropped, so the connection stays usable.
                continue;
            }
            if let Some(buffer) = joined.as_mut() {
                buffer.extend_from_slice(&chunk);
            } else if let Some(head) = first.take() {
                let mut buffer = BytesMut::with_capacity(head.len() + chunk.len());
                buffer.extend_from_slice(&head);
                buffer.extend_from_slice(&chunk);
                joined = Some(buffer);
            } else {
                first = Some(chunk);
            }
        }
        if total > self.max_body_bytes {
            self.failure = Some(Failure::EngineBroke(format!(
                "the engine's answer is larger than {} bytes (grpc.max_message_bytes)",
                self.max_body_bytes
            )));
            return RelayEnd::Complete;
        }
        let body = joined.map(BytesMut::freeze).or(first).unwrap_or_default();
        match parse_completion(&body) {
            Ok(piece) => {
                if !self.sink.send(self.reply.response(piece, true)).await {
                    return RelayEnd::ClientGone;
                }
            }
            Err(detail) => self.failure = Some(Failure::EngineBroke(detail)),
        }
        RelayEnd::Complete
    }

    /// A streamed completion: a response per chunk (or one folded response). The final
    /// chunk is held until the usage chunk after it, so the last response carries the
    /// token counts.
    async fn relay_events(
        &mut self,
        upstream: &mut UpstreamSession,
        mut relay: Relay<'_>,
    ) -> RelayEnd {
        let mut parser = SseData::default();
        let mut timing = TokenTiming::default();
        let mut held: Option<Piece> = None;
        let mut folded = Piece::default();
        loop {
            let chunk = match read(upstream, self.sink, relay.idle).await {
                Read::Chunk(chunk) => chunk,
                Read::Done => break,
                Read::Failed(kind) => return self.broke_off(kind),
                Read::Gone => return RelayEnd::ClientGone,
            };
            relay.chunk(&chunk, true);
            let mut events = 0;
            let mut pieces = Vec::new();
            let mut error = None;
            parser.feed(&chunk, |data| {
                if data == DONE {
                    return;
                }
                events += 1;
                match parse_completion(data) {
                    Ok(piece) => pieces.push(piece),
                    Err(detail) => {
                        error.get_or_insert(detail);
                    }
                }
            });
            timing.observe(events, relay.started, relay.metrics);
            if parser.pending_len() > self.max_body_bytes {
                return self.broke_off(FailureKind::Reset);
            }
            if let Some(detail) = error {
                self.failure.get_or_insert(Failure::EngineBroke(detail));
            }
            if self.failure.is_some() {
                // Drain the rest so the connection stays usable; nothing more is sent.
                continue;
            }
            for piece in pieces {
                if !self.deltas {
                    folded.absorb(piece);
                    continue;
                }
                if piece.is_usage_only() {
                    match held.as_mut() {
                        Some(last) => last.usage = piece.usage,
                        None => held = Some(piece),
                    }
                    continue;
                }
                if let Some(previous) = held.take()
                    && !self.sink.send(self.reply.response(previous, false)).await
                {
                    return RelayEnd::ClientGone;
                }
                if piece.finish_reason.is_some() {
                    held = Some(piece);
                } else if !self.sink.send(self.reply.response(piece, false)).await {
                    return RelayEnd::ClientGone;
                }
            }
        }
        if self.failure.is_some() {
            return RelayEnd::Complete;
        }
        let last = if self.deltas {
            held.unwrap_or_default()
        } else {
            folded
        };
        if !self.sink.send(self.reply.response(last, true)).await {
            return RelayEnd::ClientGone;
        }
        RelayEnd::Complete
    }

    /// The engine broke off mid-answer.
    fn broke_off(&mut self, kind: FailureKind) -> RelayEnd {
        let detail = match kind {
            FailureKind::Timeout => "the engine stopped sending within the idle timeout",
            _ => "the engine connection broke mid-answer",
        };
        self.failure = Some(Failure::EngineBroke(detail.to_string()));
        RelayEnd::UpstreamFailed { kind, clean: true }
    }
}

impl Downstream for GrpcDownstream<'_> {
    fn upstream_request(
        &self,
        target: &UpstreamTarget<'_>,
    ) -> pingora_error::Result<RequestHeader> {
        upstream_request(self.head, target)
    }

    async fn gone(&mut self) {
        self.sink.closed().await;
    }

    async fn reject(
        &mut self,
        exchange: &mut Exchange,
        _metrics: &Metrics,
        error: &ApiError,
    ) -> bool {
        // Client errors are counted once, when the request's record is written.
        exchange.status = error.status();
        self.failure = Some(Failure::Api(error.clone()));
        true
    }

    async fn relay(
        &mut self,
        state: &State,
        pool: &ModelPool,
        answer: &Answer<'_>,
        upstream: &mut UpstreamSession,
        exchange: &mut Exchange,
    ) -> RelayEnd {
        let idle = state.limits.idle_timeout;
        if exchange.status != 200 {
            return self.engine_error(upstream, exchange.status, idle).await;
        }
        let streamed = upstream.is_event_stream();
        let relay = Relay {
            started: exchange.started,
            idle,
            metrics: pool.metrics(),
            prefill: answer.booking,
            meter: exchange.meter.as_ref(),
        };
        if streamed {
            self.relay_events(upstream, relay).await
        } else {
            self.relay_whole(upstream, relay).await
        }
    }
}

//! The gRPC front end's client of one request: the engine's OpenAI completion answer
//! (JSON, or server-sent events when streaming), relayed by the spine, becomes
//! `ModelInferResponse`s, sent as they come (streaming) or as one (folded); proxy errors
//! and engine errors become a [`Failure`].

use bytes::{Bytes, BytesMut};
use kvmesh_proto::inference::{ModelInferResponse, ModelStreamInferResponse};
use kvmesh_telemetry::traceparent::{TRACEPARENT, TRACESTATE};
use kvmesh_wire::engine_json::{Piece, error_message, parse_completion};
use kvmesh_wire::sse_events::{DONE, SseData};
use pingora_http::RequestHeader;
use tokio::sync::mpsc;
use tonic::Status;

use crate::engines::upstream_session::UpstreamSession;
use crate::frontend::grpc::call::Call;
use crate::frontend::grpc::failure::Failure;
use crate::frontend::grpc::outputs::Reply;
use crate::metrics::failure::FailureKind;
use crate::metrics::families::Metrics;
use crate::openai::api_error::ApiError;
use crate::openai::headers::{ClientFraming, ProxyHeaders, upstream_request};
use crate::openai::headers::{EngineHead, EngineTarget, InvalidHead};
use crate::request::frontend::{Frontend, Unrelayable};
use crate::request::record::Record;

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

/// How the engine's answer is being read.
#[derive(Debug, Default)]
enum Answer {
    /// No answer yet.
    #[default]
    None,
    /// An engine error status: its body is kept for the message.
    Error {
        /// The status.
        status: u16,
        /// The body so far (at most [`MAX_ERROR_BODY`] bytes).
        body: BytesMut,
    },
    /// A whole (non-streamed) completion, joined as it arrives.
    Whole {
        /// The body so far (dropped once over the limit).
        body: BytesMut,
        /// Bytes received.
        total: usize,
    },
    /// A streamed completion: a response per chunk (or one folded response). The final
    /// chunk is held until the usage chunk after it, so the last response carries the
    /// token counts.
    Events {
        /// Event data across pieces.
        parser: SseData,
        /// The chunk held back (deltas).
        held: Option<Piece>,
        /// Everything so far (folded).
        folded: Piece,
    },
}

/// The gRPC client of one proxied request.
pub(crate) struct GrpcClient<'a> {
    head: &'a RequestHeader,
    /// The call's metadata (its trace context).
    call: &'a Call,
    sink: &'a mut Sink,
    reply: &'a Reply,
    /// Send each generated chunk as it comes (else one folded response).
    deltas: bool,
    /// Largest engine answer (or streamed event) accepted.
    max_body_bytes: usize,
    answer: Answer,
    failure: Option<Failure>,
}

impl<'a> GrpcClient<'a> {
    /// A client of `call` whose engine request is built from `head` and whose responses,
    /// shaped by `reply`, go to `sink`: one per generated chunk when `deltas`, else one.
    pub(crate) fn new(
        head: &'a RequestHeader,
        call: &'a Call,
        sink: &'a mut Sink,
        reply: &'a Reply,
        deltas: bool,
        max_body_bytes: usize,
    ) -> Self {
        Self {
            head,
            call,
            sink,
            reply,
            deltas,
            max_body_bytes,
            answer: Answer::None,
            failure: None,
        }
    }

    /// Why the request failed, if it did.
    pub(crate) fn into_failure(self) -> Option<Failure> {
        self.failure
    }

    /// Takes in a piece of a whole completion; at its end, sends the one response.
    async fn whole(&mut self, data: &[u8], end: bool) -> bool {
        let Answer::Whole { body, total } = &mut self.answer else {
            return true;
        };
        *total = total.saturating_add(data.len());
        if *total <= self.max_body_bytes {
            body.extend_from_slice(data);
        } else {
            // Drained and dropped, so the connection stays usable.
            body.clear();
        }
        if !end {
            return true;
        }
        if *total > self.max_body_bytes {
            self.failure = Some(Failure::EngineBroke(format!(
                "the engine's answer is larger than {} bytes (grpc.max_message_bytes)",
                self.max_body_bytes
            )));
            return true;
        }
        match parse_completion(body) {
            Ok(piece) => self.sink.send(self.reply.response(piece, true)).await,
            Err(detail) => {
                self.failure = Some(Failure::EngineBroke(detail));
                true
            }
        }
    }

    /// Takes in events of a streamed completion: a response per chunk (deltas), or one
    /// folded response at the end.
    async fn events(&mut self, data: &[u8], end: bool) -> bool {
        let Answer::Events {
            parser,
            held,
            folded,
        } = &mut self.answer
        else {
            return true;
        };
        let mut pieces = Vec::new();
        let mut error = None;
        parser.feed(data, |event| {
            if event == DONE {
                return;
            }
            match parse_completion(event) {
                Ok(piece) => pieces.push(piece),
                Err(detail) => {
                    error.get_or_insert(detail);
                }
            }
        });
        if parser.pending_len() > self.max_body_bytes {
            // The connection is cut rather than drained.
            self.failure = Some(broke_off(FailureKind::Reset));
            return false;
        }
        if let Some(detail) = error {
            self.failure.get_or_insert(Failure::EngineBroke(detail));
        }
        if self.failure.is_some() {
            // Drain the rest so the connection stays usable; nothing more is sent.
            return true;
        }
        for piece in pieces {
            if !self.deltas {
                folded.absorb(piece);
                continue;
            }
            if piece.is_usage_only() {
                match held.as_mut() {
                    Some(last) => last.usage = piece.usage,
                    None => *held = Some(piece),
                }
                continue;
            }
            if let Some(previous) = held.take()
                && !self.sink.send(self.reply.response(previous, false)).await
            {
                return false;
            }
            if piece.finish_reason.is_some() {
                *held = Some(piece);
            } else if !self.sink.send(self.reply.response(piece, false)).await {
                return false;
            }
        }
        if !end {
            return true;
        }
        let last = if self.deltas {
            held.take().unwrap_or_default()
        } else {
            std::mem::take(folded)
        };
        self.sink.send(self.reply.response(last, true)).await
    }
}

/// The failure of an engine that broke off mid-answer.
fn broke_off(kind: FailureKind) -> Failure {
    let detail = match kind {
        FailureKind::Timeout => "the engine stopped sending within the idle timeout",
        FailureKind::Left => "the engine instance left service discovery mid-answer",
        _ => "the engine connection broke mid-answer",
    };
    Failure::EngineBroke(detail.to_string())
}

impl Frontend for GrpcClient<'_> {
    fn engine_request(&self, target: &EngineTarget<'_>) -> Result<EngineHead, InvalidHead> {
        Ok(upstream_request(self.head, target))
    }

    /// The call's `traceparent` and `tracestate` metadata; other names: the engine head's.
    fn header(&self, name: &str) -> Option<&str> {
        let metadata = if name.eq_ignore_ascii_case(TRACEPARENT) {
            &self.call.traceparent
        } else if name.eq_ignore_ascii_case(TRACESTATE) {
            &self.call.tracestate
        } else {
            return self.head.headers.get(name)?.to_str().ok();
        };
        metadata.as_ref()?.to_str().ok()
    }

    fn query(&self) -> Option<&str> {
        None
    }

    async fn gone(&mut self) {
        self.sink.closed().await;
    }

    async fn reject(&mut self, record: &mut Record, _metrics: &Metrics, error: &ApiError) -> bool {
        // Client errors are counted once, when the request's record is written.
        record.status = error.status();
        self.failure = Some(Failure::Api(error.clone()));
        true
    }

    /// Nothing is written yet: the answer is read according to its status and type.
    async fn start_response(
        &mut self,
        engine: &UpstreamSession,
        _ours: ProxyHeaders<'_>,
    ) -> Result<ClientFraming, Unrelayable> {
        self.answer = match engine.status() {
            Some(200) if engine.is_event_stream() => Answer::Events {
                parser: SseData::default(),
                held: None,
                folded: Piece::default(),
            },
            Some(200) => Answer::Whole {
                body: BytesMut::new(),
                total: 0,
            },
            Some(status) => Answer::Error {
                status,
                body: BytesMut::new(),
            },
            None => return Err(Unrelayable::EngineHead),
        };
        Ok(ClientFraming::Open)
    }

    async fn write_body(&mut self, data: Bytes, end: bool) -> bool {
        match &mut self.answer {
            Answer::Error { status, body } => {
                let room = MAX_ERROR_BODY.saturating_sub(body.len());
                body.extend_from_slice(&data[..data.len().min(room)]);
                if end {
                    self.failure = Some(Failure::Engine {
                        status: *status,
                        message: error_message(body),
                    });
                }
                true
            }
            Answer::Whole { .. } => self.whole(&data, end).await,
            Answer::Events { .. } => self.events(&data, end).await,
            Answer::None => true,
        }
    }

    async fn end_broken(&mut self, kind: FailureKind, _error_event: Option<Bytes>) -> bool {
        self.failure = Some(match &self.answer {
            Answer::Error { status, body } => Failure::Engine {
                status: *status,
                message: error_message(body),
            },
            _ => broke_off(kind),
        });
        true
    }
}

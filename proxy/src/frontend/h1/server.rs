//! The fast path's connection loop: reads request heads and bodies itself, refuses heads
//! that break RFC 9112 ([`kvmesh_h1::strict`]: 400 and a lingering close), hands the
//! proxied OpenAI routes to the spine ([`crate::request::proxy`]) as pingora's path does, and
//! hands the connection (with every byte already read) to pingora for anything else.
//!
//! A request answered before its body was read (401, 408, 413, 400 on a malformed chunked
//! body) ends the connection with a lingering close ([`kvmesh_h1::linger`]), so that a
//! client still writing its body reads the answer instead of a reset.

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::BytesMut;
use http::{HeaderValue, Method};
use kvmesh_config::LimitsConfig;
use kvmesh_h1::body::Framing;
use kvmesh_h1::fields::{is_100_continue, listed_in_connection};
use kvmesh_h1::head::{Known, Parsed, RequestHead, parse_request};
use kvmesh_h1::linger::lingering_close;
use kvmesh_h1::strict::{Violation, request_framing};
use kvmesh_h1::waits::{Waits, Woken};
use pingora_core::server::ShutdownWatch;
use tokio::io::AsyncReadExt;
use tokio::sync::watch::error::RecvError;
use tokio::time::Instant;

use super::client::{BodyRead, FastConnection};
use super::io::{ClientIo, READ_RESERVE};
use crate::edge::auth::AuthFailure;
use crate::edge::edge_metrics::Peer;
use crate::edge::limits::{SHUTDOWN_GRACE, answer_raw, check_head_size};
use crate::openai::api_error::{ApiError, ClientErrorReason};
use crate::openai::route::{EngineRoutes, Route, RouteMatch, match_route};
use crate::request::body::streams;
use crate::request::frontend::Frontend;
use crate::request::proxy;
use crate::request::record::Record;
use crate::state::shared::State;

/// Longest partial head read before the connection goes to pingora (which answers 431).
const MAX_HEAD: usize = 64 * 1024;

/// How a fast-path connection ended.
pub(crate) enum ConnectionEnd {
    /// It is to be closed.
    Done,
    /// Pingora serves the rest, beginning with these bytes already read, unparsed.
    Handover(BytesMut),
}

/// How reading a head ended.
enum HeadRead {
    Head(RequestHead),
    Closed,
    TimedOut,
    /// Not something the fast path parses (invalid, or too large): pingora answers it.
    Handover,
}

/// A request the fast path serves.
struct FastRequest {
    route: Route,
    /// How its body is delimited (a length, or chunked).
    framing: Framing,
    /// The client asked to close the connection after the response.
    close: bool,
    /// The client waits for `100 Continue` before it sends the body (`Expect`).
    expects_continue: bool,
}

/// Serves `io` (a TCP connection, or a TLS one that chose HTTP/1.1) until it closes, or until
/// a request the fast path does not serve.
pub(crate) async fn serve<S: ClientIo>(
    io: &mut S,
    states: &ArcSwap<State>,
    shutdown: &ShutdownWatch,
) -> ConnectionEnd {
    let mut buf = BytesMut::with_capacity(READ_RESERVE);
    let mut out = Vec::with_capacity(1024);
    let mut fresh = true;
    let mut signal = shutdown.clone();
    let draining = *signal.borrow_and_update();
    let changed = pin!(signal.changed());
    let mut waits = Waits::new(changed, draining);
    loop {
        let head_timeout = states.load().limits.client_header_timeout;
        let head = match read_head(io, &mut buf, head_timeout, &mut waits, fresh).await {
            HeadRead::Head(head) => head,
            HeadRead::Closed => return ConnectionEnd::Done,
            HeadRead::TimedOut => {
                let state = states.load();
                state
                    .metrics
                    .client_error(ClientErrorReason::RequestTimeout);
                answer_raw(io, &ApiError::RequestTimeout).await;
                return ConnectionEnd::Done;
            }
            HeadRead::Handover => return ConnectionEnd::Handover(buf),
        };
        // The state this request runs on to its end, whatever reloads happen meanwhile.
        let state = states.load_full();
        let framing = match request_framing(&head) {
            Ok(framing) => framing,
            Err(violation) => {
                refuse(&state, io, &mut buf, &mut out, &head, violation).await;
                return ConnectionEnd::Done;
            }
        };
        let Some(request) = fast_request(&head, framing, &state.limits, &state.engine_routes)
        else {
            let mut read = BytesMut::with_capacity(head.raw().len() + buf.len());
            read.extend_from_slice(head.raw());
            read.extend_from_slice(&buf);
            return ConnectionEnd::Handover(read);
        };
        let close = request.close || *shutdown.borrow();
        let client_id = head
            .fields
            .get(Known::RequestId)
            .and_then(|id| HeaderValue::from_bytes(id).ok());
        let mut record = Record::new(state.request_ids.resolve(client_id.as_ref()));
        record.route = Some(request.route);
        let mut client = FastConnection::new(io, &mut buf, &mut out, &head, close);
        let reusable = serve_request(&state, &mut client, &mut record, &head, &request).await;
        let close = client.close;
        // Answered before the body was read: the client may still be writing it.
        let linger = !client.body_read && !request.framing.is_done() && !record.client_gone;
        record.finish(&state.registry, &Method::POST, head.path());
        if !reusable || close || *shutdown.borrow() {
            if linger {
                // Boxed: the future exists only while a connection lingers.
                Box::pin(lingering_close(&mut *io)).await;
            }
            return ConnectionEnd::Done;
        }
        fresh = false;
    }
}

/// Answers a head that breaks RFC 9112 (`violation`) with 400, then closes the connection
/// with a lingering close (what follows the head cannot be told apart from a next request).
async fn refuse<S: ClientIo>(
    state: &State,
    io: &mut S,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    head: &RequestHead,
    violation: Violation,
) {
    tracing::debug!(reason = violation.label(), "request framing refused");
    state.metrics.edge.count_framing(Peer::Client, violation);
    let method = Method::from_bytes(head.method()).unwrap_or_default();
    let client_id = head
        .fields
        .get(Known::RequestId)
        .and_then(|id| HeaderValue::from_bytes(id).ok());
    let mut record = Record::new(state.request_ids.resolve(client_id.as_ref()));
    if let RouteMatch::Found(route) = match_route(&state.engine_routes, &method, head.path()) {
        record.route = Some(route);
    }
    let mut client = FastConnection::new(io, buf, out, head, true);
    client
        .reject(
            &mut record,
            &state.metrics,
            &ApiError::InvalidFraming(violation),
        )
        .await;
    record.finish(&state.registry, &method, head.path());
    if !record.client_gone {
        Box::pin(lingering_close(io)).await;
    }
}

/// Authentication and the body, then the spine; returns whether the connection
/// can serve another request.
async fn serve_request<S: ClientIo>(
    state: &State,
    client: &mut FastConnection<'_, S>,
    record: &mut Record,
    head: &RequestHead,
    request: &FastRequest,
) -> bool {
    let key = match state
        .auth
        .authenticate_value(head.fields.get(Known::Authorization))
    {
        Ok(Some(key)) => {
            client.strip_authorization = true;
            Some(key)
        }
        Ok(None) => None,
        Err(failure) => {
            // The body is left unread: the connection cannot serve another request.
            client.close = true;
            let error = ApiError::Unauthorized {
                missing: failure == AuthFailure::Missing,
            };
            return client.reject(record, &state.metrics, &error).await;
        }
    };
    let deadline = record.started + state.limits.client_header_timeout;
    let limit = state.limits.max_body_bytes;
    // A body announced over the limit is refused without asking for it.
    if request.expects_continue
        && request.framing.announced() <= limit
        && !client.write_continue().await
    {
        record.client_gone = true;
        return false;
    }
    let streams = streams(request.route, head.fields.get(Known::ContentType));
    let limits = (limit, state.limits.client_header_timeout);
    let error = match client
        .read_body(request.framing, limits, deadline, streams)
        .await
    {
        Ok(body) => return proxy(state, client, record, key, body).await,
        Err(BodyRead::Gone) => {
            record.client_gone = true;
            return false;
        }
        Err(BodyRead::Timeout) => ApiError::RequestTimeout,
        Err(BodyRead::TooLarge) => ApiError::BodyTooLarge { limit },
        Err(BodyRead::Malformed) => {
            tracing::debug!("malformed chunked request body");
            state
                .metrics
                .edge
                .count_framing(Peer::Client, Violation::Chunk);
            ApiError::InvalidFraming(Violation::Chunk)
        }
    };
    // The rest of the body is left unread: the connection cannot serve another request.
    client.close = true;
    client.reject(record, &state.metrics, &error).await
}

/// The request, when the fast path serves it: `POST` to a proxied route over HTTP/1.1, its
/// body `framing` by length or chunked, with a head within the limits, no `Expect` but
/// `100-continue` and at most one `Connection` field.
fn fast_request(
    head: &RequestHead,
    framing: Framing,
    limits: &LimitsConfig,
    routes: &EngineRoutes,
) -> Option<FastRequest> {
    if head.method() != b"POST" || head.minor_version != 1 {
        return None;
    }
    let RouteMatch::Found(route) = match_route(routes, &Method::POST, head.path()) else {
        return None;
    };
    // Several `Connection` fields, and expectations other than `100-continue`, are pingora's
    // to judge.
    let fields = &head.fields;
    let expects_continue = match fields.get(Known::Expect) {
        None => false,
        Some(value) if is_100_continue(value) => true,
        Some(_) => return None,
    };
    if !route.is_proxied() || fields.repeated(Known::Expect) || fields.repeated(Known::Connection) {
        return None;
    }
    let line = head.method().len() + head.target().len();
    let field_bytes = head
        .fields
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    check_head_size(line, head.fields.len(), field_bytes, limits).ok()?;
    let close = fields
        .get(Known::Connection)
        .is_some_and(|value| listed_in_connection(value, b"close"));
    Some(FastRequest {
        route,
        framing,
        close,
        expects_continue,
    })
}

/// Reads a request head within `limit`. Once shutdown begins, a connection gets a short
/// grace to deliver a head already on its way. `fresh`: the connection's first request (a
/// timeout is then a slow client, not an idle keep-alive connection).
async fn read_head<S: ClientIo, C: Future<Output = Result<(), RecvError>>>(
    io: &mut S,
    buf: &mut BytesMut,
    limit: Duration,
    waits: &mut Waits<'_, C>,
    fresh: bool,
) -> HeadRead {
    // Set when the head is not all here yet (a request already read costs no clock read).
    let mut deadline = None;
    loop {
        if !buf.is_empty() {
            match parse_request(buf) {
                Parsed::Complete(head) => return HeadRead::Head(head),
                Parsed::Invalid => return HeadRead::Handover,
                Parsed::Partial if buf.len() > MAX_HEAD => return HeadRead::Handover,
                Parsed::Partial => {}
            }
        }
        buf.reserve(READ_RESERVE);
        // Bytes already waiting are taken without arming the timers.
        match io.try_read_buf(buf) {
            Ok(0) => return HeadRead::Closed,
            Ok(_) => continue,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return HeadRead::Closed,
        }
        let until = *deadline.get_or_insert_with(|| {
            Instant::now()
                + if waits.draining {
                    SHUTDOWN_GRACE
                } else {
                    limit
                }
        });
        let read = tokio::select! {
            biased;
            read = io.read_buf(buf) => read,
            woken = waits.wait(until) => match woken {
                Woken::Shutdown => {
                    deadline = Some(until.min(Instant::now() + SHUTDOWN_GRACE));
                    continue;
                }
                Woken::Deadline if fresh && !waits.draining => return HeadRead::TimedOut,
                Woken::Deadline => return HeadRead::Closed,
            },
        };
        match read {
            Ok(0) | Err(_) => return HeadRead::Closed,
            Ok(_) => {}
        }
    }
}

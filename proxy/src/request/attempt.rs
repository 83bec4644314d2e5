//! One attempt on one instance (phase 5 of [`crate::request`]): the request sent, and the
//! engine's response head read within the first-byte timeout, over our HTTP/1.1 client
//! (plaintext HTTP/1.1 engines: head and body in one write) or pingora's (h2c and
//! `https://` engines). A streamed body ([`crate::request::body`]) goes out as the client
//! sends it, each write to the engine within the first-byte timeout, and the first-byte
//! timeout runs from its end.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use tokio::time::timeout;

use crate::edge::edge_metrics::Peer;
use crate::edge::retry::RetryReason;
use crate::engines::clock::now_millis;
use crate::engines::instance::Instance;
use crate::engines::pool::ModelPool;
use crate::engines::upstream::{
    Outgoing, SentLeg, pingora_exchange, pingora_failure, pingora_head, pingora_request,
    pingora_send,
};
use crate::engines::upstream_session::UpstreamSession;
use crate::metrics::failure::FailureKind;
use crate::openai::api_error::ApiError;
use crate::openai::headers::{EngineTarget, TraceHeaders};
use crate::request::body::{BodyRest, PieceError};
use crate::request::frontend::{Frontend, unless_gone};
use crate::request::pick::{Pick, overloaded};
use crate::request::stop::Stop;
use crate::state::shared::State;
use kvmesh_h1::client::{Roundtrip, RoundtripError, TimedOut};
use kvmesh_route::{CandidateSet, Candidates, Excluded, NoPick};
use pingora_core::protocols::http::client::HttpSession;

/// How one attempt on one instance ended before any response byte reached the client.
pub(crate) enum AttemptError {
    /// Nothing usable came back; another instance may be tried.
    Retryable {
        kind: FailureKind,
        detail: String,
        /// The connection came from the pool (it may just have been stale).
        reused: bool,
    },
    /// No response headers within the first-byte timeout.
    Timeout,
    /// The request could not be rebuilt for the engine (not the engine's fault).
    Unforwardable(String),
    /// The client went away while waiting.
    ClientGone,
    /// The rest of a streamed body could not be read from the client.
    Client(PieceError),
}

/// Extra attempts after a failure on a pooled keep-alive connection (it may
/// have gone stale while idle); they count neither as failures towards
/// ejection nor against `limits.retries`.
const STALE_CONNECTION_RETRIES: u32 = 2;

/// What one request has tried so far, and how many more attempts it may make: every retry
/// goes to another instance and counts against `limits.retries`; retries of an engine's
/// answer (a retryable status, a first-byte timeout) also take one from the model's retry
/// budget and wait a backoff first.
pub(crate) struct Failover {
    /// Instances that failed before the first byte.
    pub(crate) excluded: Excluded,
    attempts_left: u32,
    stale_retries_left: u32,
    last_failure: Option<String>,
    /// Retries of engine answers so far (the backoff grows with them).
    answer_retries: u32,
    /// The wait owed before the next attempt.
    backoff: Option<Duration>,
}

impl Failover {
    /// A request to `pool` that may retry `limits.retries` times on other instances; it is
    /// counted in the model's retry budget.
    pub(crate) fn new(state: &State, pool: &ModelPool) -> Self {
        pool.retry_budget().request(&state.retry, now_millis());
        Self::for_leg(state)
    }

    /// A disaggregated request's prefill leg, which may retry as the request may; the
    /// request is already counted in the model's retry budget.
    pub(crate) fn for_leg(state: &State) -> Self {
        Self {
            excluded: Excluded::default(),
            attempts_left: state.limits.retries.saturating_add(1),
            stale_retries_left: STALE_CONNECTION_RETRIES,
            last_failure: None,
            answer_retries: 0,
            backoff: None,
        }
    }

    /// The error when no instance is left to pick.
    pub(crate) fn exhausted(&mut self, state: &State, pool: &ModelPool, why: NoPick) -> ApiError {
        match (why, self.last_failure.take()) {
            (NoPick::Busy, _) => overloaded(pool, "every remaining instance is busy"),
            (NoPick::Nothing, None) => ApiError::NoHealthyInstance {
                model: pool.name().to_string(),
                retry_after_secs: pool.retry_after_secs(state.health_interval_ms),
            },
            (NoPick::Nothing, Some(detail)) => ApiError::UpstreamUnavailable { detail },
        }
    }

    /// Judges the failed attempt on `pick` (one of `instances` of `pool`): `Ok` to try
    /// again, `Err` to stop. Failures count towards the instance's ejection, except a first
    /// stale pooled connection.
    pub(crate) fn failed(
        &mut self,
        state: &State,
        pool: &ModelPool,
        instances: &[Arc<Instance>],
        pick: &Pick<'_>,
        error: AttemptError,
    ) -> Result<(), Stop> {
        let instance = &pick.instance;
        match error {
            AttemptError::Retryable {
                kind,
                detail,
                reused,
            } => {
                if reused && self.stale_retries_left > 0 {
                    self.stale_retries_left -= 1;
                    instance.count_error(kind);
                    tracing::debug!(instance = %instance.url(), %detail, "stale pooled connection, retrying");
                    return Ok(());
                }
                instance.record_failure(kind, &state.outlier, now_millis());
                tracing::debug!(instance = %instance.url(), %detail, "attempt failed before the first byte");
                self.excluded.insert(pick.index);
                self.attempts_left -= 1;
                if self.attempts_left == 0 {
                    return Err(Stop::Answer(ApiError::UpstreamUnavailable { detail }));
                }
                pool.metrics().retries[RetryReason::Connect.index()].inc();
                self.last_failure = Some(detail);
                Ok(())
            }
            AttemptError::Timeout => {
                instance.record_failure(FailureKind::Timeout, &state.outlier, now_millis());
                let retried = state.retry.retries_timeout()
                    && self.retry_answer(state, pool, instances, pick, RetryReason::Timeout);
                if !retried {
                    return Err(Stop::Answer(ApiError::UpstreamTimeout));
                }
                tracing::debug!(instance = %instance.url(), "no response head in time, retrying");
                Ok(())
            }
            AttemptError::Unforwardable(detail) => {
                Err(Stop::Answer(ApiError::UpstreamUnavailable { detail }))
            }
            AttemptError::ClientGone => Err(Stop::ClientGone),
            AttemptError::Client(error) => {
                if error == PieceError::Malformed {
                    tracing::debug!("malformed chunked request body");
                    let chunk = kvmesh_h1::strict::Violation::Chunk;
                    state.metrics.edge.count_framing(Peer::Client, chunk);
                }
                Err(error.into())
            }
        }
    }

    /// Makes the next failure final: a streamed body that cannot be sent again.
    pub(crate) fn last_attempt(&mut self) {
        self.attempts_left = self.attempts_left.min(1);
        self.stale_retries_left = 0;
    }

    /// Whether the engine's answer with `status` from `pick` is dropped and the request
    /// tried again elsewhere (nothing of it reached the client yet).
    pub(crate) fn retries_status(
        &mut self,
        state: &State,
        pool: &ModelPool,
        instances: &[Arc<Instance>],
        pick: &Pick<'_>,
        status: u16,
    ) -> bool {
        let retried = state.retry.retries_status(status)
            && self.retry_answer(state, pool, instances, pick, RetryReason::Status);
        if retried {
            tracing::debug!(instance = %pick.instance.url(), status, "retryable answer, retrying");
        }
        retried
    }

    /// Takes a retry of an engine's answer on `pick` when the request has attempts left,
    /// another instance can take it and the model's budget allows; it is then owed a backoff.
    fn retry_answer(
        &mut self,
        state: &State,
        pool: &ModelPool,
        instances: &[Arc<Instance>],
        pick: &Pick<'_>,
        reason: RetryReason,
    ) -> bool {
        self.excluded.insert(pick.index);
        let now = now_millis();
        let elsewhere = Candidates::new(instances, &self.excluded, now).eligible_count() > 0;
        if self.attempts_left <= 1 || !elsewhere {
            return false;
        }
        if !pool.retry_budget().try_retry(&state.retry, now) {
            pool.metrics().retry_budget_exhausted.inc();
            return false;
        }
        self.attempts_left -= 1;
        self.answer_retries += 1;
        self.backoff = Some(state.retry.backoff(self.answer_retries));
        pool.metrics().retries[reason.index()].inc();
        true
    }

    /// Waits the backoff owed by the last retry, if any, unless `frontend`'s client leaves
    /// first.
    pub(crate) async fn backoff<F: Frontend>(&mut self, frontend: &mut F) -> Result<(), Stop> {
        let Some(wait) = self.backoff.take() else {
            return Ok(());
        };
        unless_gone(frontend, tokio::time::sleep(wait))
            .await
            .ok_or(Stop::ClientGone)
    }
}

/// Sends the request to `pick`'s instance (on its data-parallel rank, if routing chose
/// one; with `trace`'s context while tracing) and waits for its response headers. `body` is
/// the whole body, or the start of a streamed one whose `rest` is read from `client` as it
/// is sent.
pub(crate) async fn attempt<F: Frontend>(
    state: &State,
    client: &mut F,
    pick: &Pick<'_>,
    (body, rest): (&Bytes, Option<&mut BodyRest>),
    request_id: &HeaderValue,
    trace: Option<&TraceHeaders>,
) -> Result<UpstreamSession, AttemptError> {
    let instance = &*pick.instance;
    let body_len = match &rest {
        None => Some(body.len() as u64),
        Some(rest) => rest.length,
    };
    let target = engine_target(pick, body_len, request_id, trace);
    let body = Outbound { start: body, rest };
    match instance.h1_address() {
        Some(address) => attempt_h1(state, client, instance, address, body, &target).await,
        None => attempt_pingora(state, client, instance, body, &target).await,
    }
}

/// The body of an attempt: whole, or the start of a streamed one and its rest.
struct Outbound<'a> {
    start: &'a Bytes,
    rest: Option<&'a mut BodyRest>,
}

/// Sends the request to `pick`'s instance without waiting for its answer (a leg whose
/// answer comes only once another leg runs: SGLang's prefill leg), on pingora's client.
pub(crate) async fn send_leg<F: Frontend>(
    state: &State,
    client: &mut F,
    pick: &Pick<'_>,
    body: &Bytes,
    request_id: &HeaderValue,
    trace: Option<&TraceHeaders>,
) -> Result<SentLeg, AttemptError> {
    let instance = &*pick.instance;
    let target = engine_target(pick, Some(body.len() as u64), request_id, trace);
    let Outgoing {
        request,
        mut session,
        reused,
    } = pingora_session(state, client, instance, &target).await?;
    let send = pingora_send(&mut session, request, body);
    match within_first_byte(state, client, send).await? {
        Err((kind, error)) => Err(AttemptError::Retryable {
            kind,
            detail: format!("{} while sending: {error}", instance.url()),
            reused,
        }),
        Ok(()) => Ok(SentLeg::new(session)),
    }
}

/// Runs `exchange` (sending the request and reading the response head) within the
/// first-byte timeout, unless the client leaves first.
async fn within_first_byte<F: Frontend, T>(
    state: &State,
    client: &mut F,
    exchange: impl Future<Output = T>,
) -> Result<T, AttemptError> {
    unless_gone(client, timeout(state.limits.first_byte_timeout, exchange))
        .await
        .ok_or(AttemptError::ClientGone)?
        .map_err(|_| AttemptError::Timeout)
}

/// A failed connect to `instance`: retryable elsewhere.
fn connect_failed(instance: &Instance, error: impl std::fmt::Display) -> AttemptError {
    AttemptError::Retryable {
        kind: FailureKind::Connect,
        detail: format!("connect to {}: {error}", instance.url()),
        reused: false,
    }
}

/// [`attempt`] on our HTTP/1.1 client: head and body in one write (a streamed body: on a
/// new connection, piece by piece).
async fn attempt_h1<F: Frontend>(
    state: &State,
    client: &mut F,
    instance: &Instance,
    address: std::net::SocketAddr,
    body: Outbound<'_>,
    target: &EngineTarget<'_>,
) -> Result<UpstreamSession, AttemptError> {
    let connect_timeout = instance.connect_timeout();
    let (mut upstream, reused) = match body.rest {
        None => Roundtrip::open(state.upstream.h1(), address, connect_timeout).await,
        Some(_) => Roundtrip::open_new(address, connect_timeout)
            .await
            .map(|upstream| (upstream, false)),
    }
    .map_err(|error| connect_failed(instance, error))?;
    client
        .write_engine_request(target, upstream.request_head())
        .map_err(|error| AttemptError::Unforwardable(error.to_string()))?;
    let limit = state.limits.first_byte_timeout;
    let exchanged = match body.rest {
        // The first-byte deadline runs on the connection's own timer.
        None => unless_gone(client, upstream.request(body.start, limit)).await,
        Some(rest) => {
            let chunked = rest.length.is_none();
            let mut pieces = Pieces::new(body.start, rest);
            loop {
                let piece = pieces.next(client).await?;
                let sent = upstream.send_within(&piece, chunked, limit).await;
                match sent.map_err(|TimedOut| AttemptError::Timeout)? {
                    Ok(()) if piece.is_empty() => break,
                    Ok(()) => {}
                    Err(error) => {
                        return Err(h1_failed(state, instance, error, reused, "while sending"));
                    }
                }
            }
            unless_gone(client, upstream.read_head_within(limit)).await
        }
    };
    let exchanged = exchanged.ok_or(AttemptError::ClientGone)?;
    match exchanged.map_err(|TimedOut| AttemptError::Timeout)? {
        Ok(()) => match upstream.check_buffered() {
            Ok(()) => Ok(UpstreamSession::H1(upstream)),
            // A body framed wrongly from its start, read with the head: nothing of it has
            // reached the client, so the request fails over (or is answered 502) as one
            // whose head was malformed.
            Err(error) => Err(AttemptError::Retryable {
                kind: FailureKind::Reset,
                detail: format!("{} sent a malformed body: {error}", instance.url()),
                reused,
            }),
        },
        Err(error) => Err(h1_failed(
            state,
            instance,
            error,
            reused,
            "before the response",
        )),
    }
}

/// The attempt error of `error` in an exchange with `instance` on our HTTP/1.1 client
/// (`when`: what it was doing).
fn h1_failed(
    state: &State,
    instance: &Instance,
    error: RoundtripError,
    reused: bool,
    when: &str,
) -> AttemptError {
    AttemptError::Retryable {
        kind: match error {
            RoundtripError::Connect(_) => FailureKind::Connect,
            RoundtripError::Broken(_) => FailureKind::Reset,
            RoundtripError::Malformed(violation) => {
                state.metrics.edge.count_framing(Peer::Engine, violation);
                FailureKind::Reset
            }
        },
        detail: format!("{} {when}: {error}", instance.url()),
        reused,
    }
}

/// A streamed body's pieces, in order: its start, then what the client sends, then an empty
/// piece at the end.
struct Pieces<'a> {
    start: Option<&'a Bytes>,
    rest: &'a mut BodyRest,
    done: bool,
}

impl<'a> Pieces<'a> {
    fn new(start: &'a Bytes, rest: &'a mut BodyRest) -> Self {
        Self {
            start: Some(start),
            rest,
            done: false,
        }
    }

    /// The next piece to send (empty: the body's end). Taking one from the client makes
    /// the body one that cannot be sent again.
    async fn next<F: Frontend>(&mut self, client: &mut F) -> Result<Bytes, AttemptError> {
        if let Some(start) = self.start.take() {
            return Ok(start.clone());
        }
        while !self.done {
            self.rest.consumed = true;
            match client
                .read_body_piece()
                .await
                .map_err(AttemptError::Client)?
            {
                Some(piece) if piece.is_empty() => {}
                Some(piece) => return Ok(piece),
                None => self.done = true,
            }
        }
        Ok(Bytes::new())
    }
}

/// What the engine request to `pick`'s instance adds to the client's.
fn engine_target<'a>(
    pick: &'a Pick<'_>,
    body_len: Option<u64>,
    request_id: &'a HeaderValue,
    trace: Option<&'a TraceHeaders>,
) -> EngineTarget<'a> {
    EngineTarget {
        host: pick.instance.host_header(),
        body_len,
        request_id,
        trace,
        dp_rank: pick.dp_rank,
    }
}

/// The engine request's head for pingora's client and a session to `instance`.
async fn pingora_session<F: Frontend>(
    state: &State,
    client: &F,
    instance: &Instance,
    target: &EngineTarget<'_>,
) -> Result<Outgoing, AttemptError> {
    let unforwardable =
        |error: &dyn std::fmt::Display| AttemptError::Unforwardable(error.to_string());
    let head = client
        .engine_request(target)
        .map_err(|error| unforwardable(&error))?;
    let request = pingora_request(&head).map_err(|error| unforwardable(&error))?;
    let (session, reused) = state
        .upstream
        .session(instance.peer())
        .await
        .map_err(|error| connect_failed(instance, error))?;
    Ok(Outgoing {
        request,
        session,
        reused,
    })
}

/// [`attempt`] on pingora's client (h2c and `https://` engines).
async fn attempt_pingora<F: Frontend>(
    state: &State,
    client: &mut F,
    instance: &Instance,
    body: Outbound<'_>,
    target: &EngineTarget<'_>,
) -> Result<UpstreamSession, AttemptError> {
    let Outgoing {
        mut request,
        session: mut upstream,
        reused,
    } = pingora_session(state, client, instance, target).await?;
    let failed = |(kind, error): (FailureKind, String), when: &str| AttemptError::Retryable {
        kind,
        detail: format!("{} {when}: {error}", instance.url()),
        reused,
    };
    let Some(rest) = body.rest else {
        let exchange = pingora_exchange(&mut upstream, request, body.start);
        return match within_first_byte(state, client, exchange).await? {
            Err(error) => Err(failed(error, "before the response")),
            Ok(()) => Ok(UpstreamSession::Pingora(Box::new(upstream))),
        };
    };
    if matches!(upstream, HttpSession::H2(_)) {
        // HTTP/2 frames a body of unknown length itself.
        request.remove_header(&http::header::TRANSFER_ENCODING);
    }
    let limit = state.limits.first_byte_timeout;
    let sending = "while sending";
    timeout(limit, upstream.write_request_header(Box::new(request)))
        .await
        .map_err(|_| AttemptError::Timeout)?
        .map_err(|error| failed(pingora_failure(error), sending))?;
    let mut pieces = Pieces::new(body.start, rest);
    loop {
        let piece = pieces.next(client).await?;
        let end = piece.is_empty();
        let write = if end {
            timeout(limit, upstream.finish_request_body()).await
        } else {
            timeout(limit, upstream.write_request_body(piece, false)).await
        };
        write
            .map_err(|_| AttemptError::Timeout)?
            .map_err(|error| failed(pingora_failure(error), sending))?;
        if end {
            break;
        }
    }
    match within_first_byte(state, client, pingora_head(&mut upstream)).await? {
        Err(error) => Err(failed(error, "before the response")),
        Ok(()) => Ok(UpstreamSession::Pingora(Box::new(upstream))),
    }
}

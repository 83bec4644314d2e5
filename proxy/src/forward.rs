//! Forwarding one request: pick an instance, send, fail over on errors before
//! the first response byte, then relay the response.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;
use pingora_core::protocols::http::ServerSession;
use pingora_core::protocols::http::client::HttpSession;
use pingora_error::ErrorType;
use prometheus::IntGauge;
use tokio::time::timeout;

use crate::api_error::ApiError;
use crate::clock::now_millis;
use crate::exchange::Exchange;
use crate::failure::FailureKind;
use crate::headers::{downstream_response, is_event_stream, upstream_request};
use crate::instance::Instance;
use crate::policy::Excluded;
use crate::pool::ModelPool;
use crate::relay::{RelayContext, RelayEnd, relay};
use crate::state::State;

/// Extra attempts after a failure on a pooled keep-alive connection (it may
/// have gone stale while idle); they count neither as failures towards
/// ejection nor against `limits.retries`.
const STALE_CONNECTION_RETRIES: u32 = 2;

/// How one attempt on one instance ended before any response byte reached the client.
enum AttemptError {
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
}

/// Keeps a gauge incremented while alive.
struct GaugeGuard<'a>(&'a IntGauge);

impl<'a> GaugeGuard<'a> {
    fn new(gauge: &'a IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Forwards the request to `pool` and relays the answer. Returns whether the
/// client connection is still in a reusable state.
pub(crate) async fn forward(
    state: &State,
    session: &mut ServerSession,
    pool: &Arc<ModelPool>,
    body: Bytes,
    exchange: &mut Exchange,
) -> bool {
    let _in_flight = GaugeGuard::new(&pool.metrics().in_flight);
    let mut excluded = Excluded::default();
    let mut attempts_left = state.limits.retries.saturating_add(1);
    let mut stale_retries_left = STALE_CONNECTION_RETRIES;
    let mut last_failure: Option<String> = None;
    loop {
        let Some((index, instance)) = pool.pick(&excluded) else {
            let error = match last_failure {
                None => ApiError::NoHealthyInstance {
                    model: pool.name().to_string(),
                    retry_after_secs: pool.retry_after_secs(state.health_interval_ms),
                },
                Some(detail) => ApiError::UpstreamUnavailable { detail },
            };
            return exchange.reject(session, &state.metrics, &error).await;
        };
        let instance = Arc::clone(instance);
        exchange.instance = Some(instance.instance_header().clone());
        let in_flight = instance.start_request();
        match attempt(state, session, &instance, &body, &exchange.request_id).await {
            Ok(upstream) => {
                let reusable = respond(state, session, pool, &instance, upstream, exchange).await;
                drop(in_flight);
                return reusable;
            }
            Err(AttemptError::Retryable {
                kind,
                detail,
                reused,
            }) => {
                drop(in_flight);
                if reused && stale_retries_left > 0 {
                    stale_retries_left -= 1;
                    instance.count_error(kind);
                    tracing::debug!(instance = %instance.url(), %detail, "stale pooled connection, retrying");
                    continue;
                }
                instance.record_failure(kind, &state.outlier, now_millis());
                tracing::debug!(instance = %instance.url(), %detail, "attempt failed before the first byte");
                excluded.insert(index);
                last_failure = Some(detail);
                attempts_left -= 1;
                if attempts_left == 0 {
                    let error = ApiError::UpstreamUnavailable {
                        detail: last_failure.unwrap_or_default(),
                    };
                    return exchange.reject(session, &state.metrics, &error).await;
                }
            }
            Err(AttemptError::Timeout) => {
                drop(in_flight);
                instance.record_failure(FailureKind::Timeout, &state.outlier, now_millis());
                return exchange
                    .reject(session, &state.metrics, &ApiError::UpstreamTimeout)
                    .await;
            }
            Err(AttemptError::Unforwardable(detail)) => {
                drop(in_flight);
                let error = ApiError::UpstreamUnavailable { detail };
                return exchange.reject(session, &state.metrics, &error).await;
            }
            Err(AttemptError::ClientGone) => {
                drop(in_flight);
                exchange.client_gone = true;
                return false;
            }
        }
    }
}

/// Sends the request to `instance` and waits for its response headers.
async fn attempt(
    state: &State,
    session: &mut ServerSession,
    instance: &Instance,
    body: &Bytes,
    request_id: &HeaderValue,
) -> Result<HttpSession, AttemptError> {
    let request = upstream_request(
        session.req_header(),
        instance.host_header(),
        body.len(),
        request_id,
    )
    .map_err(|error| AttemptError::Unforwardable(error.to_string()))?;
    let (mut upstream, reused) =
        state
            .upstream
            .session(instance.peer())
            .await
            .map_err(|error| AttemptError::Retryable {
                kind: FailureKind::Connect,
                detail: format!("connect to {}: {error}", instance.url()),
                reused: false,
            })?;
    let exchange = async {
        upstream.write_request_header(Box::new(request)).await?;
        if !body.is_empty() {
            upstream.write_request_body(body.clone(), true).await?;
        }
        upstream.finish_request_body().await?;
        loop {
            upstream.read_response_header().await?;
            let informational = upstream
                .response_header()
                .is_some_and(|header| header.status.is_informational());
            if !informational {
                return Ok::<(), Box<pingora_error::Error>>(());
            }
        }
    };
    let outcome = tokio::select! {
        biased;
        outcome = timeout(state.limits.first_byte_timeout, exchange) => outcome,
        _ = session.read_body_or_idle(true) => return Err(AttemptError::ClientGone),
    };
    match outcome {
        Err(_) => Err(AttemptError::Timeout),
        Ok(Err(error)) => {
            let kind = match error.etype() {
                ErrorType::ConnectTimedout
                | ErrorType::ConnectRefused
                | ErrorType::ConnectNoRoute
                | ErrorType::ConnectError => FailureKind::Connect,
                ErrorType::ReadTimedout | ErrorType::WriteTimedout => FailureKind::Timeout,
                _ => FailureKind::Reset,
            };
            Err(AttemptError::Retryable {
                kind,
                detail: format!("{} before the response: {error}", instance.url()),
                reused,
            })
        }
        Ok(Ok(())) => Ok(upstream),
    }
}

/// Writes the engine's response head and relays its body.
async fn respond(
    state: &State,
    session: &mut ServerSession,
    pool: &ModelPool,
    instance: &Instance,
    mut upstream: HttpSession,
    exchange: &mut Exchange,
) -> bool {
    let Some(upstream_header) = upstream.response_header() else {
        return false;
    };
    let status = upstream_header.status.as_u16();
    exchange.status = status;
    if status >= 500 {
        instance.record_failure(FailureKind::Status5xx, &state.outlier, now_millis());
    } else {
        instance.record_success();
    }
    let event_stream = is_event_stream(upstream_header);
    let client_version = session.req_header().version;
    let built = downstream_response(
        upstream_header,
        instance.instance_header(),
        &exchange.request_id,
        client_version,
        session.is_http2(),
    );
    let Ok((response, framing)) = built else {
        return false;
    };
    if session
        .write_response_header(Box::new(response))
        .await
        .is_err()
    {
        exchange.client_gone = true;
        return false;
    }
    let ctx = RelayContext {
        started: exchange.started,
        idle_timeout: state.limits.idle_timeout,
        event_stream,
        framing,
        metrics: pool.metrics(),
    };
    match relay(session, &mut upstream, &ctx).await {
        RelayEnd::Complete => {
            state.upstream.release(upstream, instance.peer()).await;
            true
        }
        RelayEnd::UpstreamFailed { kind, clean } => {
            instance.record_failure(kind, &state.outlier, now_millis());
            exchange.upstream_failure = Some(kind);
            clean
        }
        RelayEnd::ClientGone => {
            exchange.client_gone = true;
            false
        }
    }
}

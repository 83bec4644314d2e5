//! Forwarding one request: pick an instance, send, fail over on errors before
//! the first response byte, then relay the response. Protocol-neutral: the client side
//! (HTTP or gRPC) is a [`Downstream`].

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::HeaderValue;
use kvmesh_h1::client::{Roundtrip, RoundtripError, TimedOut};
use pingora_error::ErrorType;
use prometheus::IntGauge;
use tokio::time::timeout;

use crate::api_error::ApiError;
use crate::clock::now_millis;
use crate::downstream::{Downstream, UpstreamTarget};
use crate::exchange::Exchange;
use crate::failure::FailureKind;
use crate::instance::Instance;
use crate::kv_route::booking::Booking;
use crate::kv_route::explain::route_header;
use crate::kv_route::offload;
use crate::kv_route::prepare::InvalidPrompt;
use crate::kv_route::{Choice, KvRequest, KvRouter};
use crate::policy::{Excluded, Policy};
use crate::pool::{Balancer, ModelPool};
use crate::relay::RelayEnd;
use crate::route::Route;
use crate::state::State;
use crate::upstream_session::UpstreamSession;

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

/// Seconds a client should wait after a 503 because every instance was busy.
const BUSY_RETRY_AFTER_SECS: u64 = 1;

/// How one request picks its instances.
pub(crate) enum Picker<'a> {
    /// A policy over the instances.
    Policy(&'a dyn Policy),
    /// `policy: kv` with the request's prompt.
    Kv {
        /// The model's router.
        router: &'a KvRouter,
        /// The request as routing sees it.
        request: KvRequest,
    },
}

impl<'a> Picker<'a> {
    /// How a request on `route` to `pool` picks its instances: the pool's policy, or KV
    /// routing by the prompt of `body` (prepared here: tokenized and hashed; `body` may be
    /// rewritten with the prompt's token ids).
    pub(crate) async fn for_request(
        state: &State,
        pool: &'a ModelPool,
        route: Route,
        body: &mut Bytes,
    ) -> Result<Self, InvalidPrompt> {
        let router = match pool.balancer() {
            Balancer::Policy(policy) => return Ok(Picker::Policy(policy.as_ref())),
            Balancer::Kv(router) => router,
        };
        let prepared = offload::prepare(
            state.preprocess.as_deref(),
            router.preparer(),
            route,
            body,
            true,
        )
        .await?;
        let request = router.request(&prepared, Instant::now());
        if let Some(rewritten) = prepared.rewritten {
            *body = rewritten;
        }
        Ok(Picker::Kv {
            router: router.as_ref(),
            request,
        })
    }
}

/// The instance chosen for one attempt, and what `policy: kv` booked for it.
struct Pick<'a> {
    index: usize,
    instance: Arc<Instance>,
    booking: Option<Booking<'a>>,
    route: Option<HeaderValue>,
}

/// What picking produced.
enum Picked<'a> {
    /// An instance.
    Instance(Pick<'a>),
    /// Nothing is available.
    Nothing,
    /// Every available instance is busy.
    Busy,
}

/// Picks the next instance of `instances` (the pool's, loaded once per request) not in
/// `excluded`.
fn pick<'a>(
    instances: &[Arc<Instance>],
    picker: &'a Picker<'a>,
    excluded: &Excluded,
) -> Picked<'a> {
    match picker {
        Picker::Policy(policy) => match ModelPool::pick(instances, *policy, excluded) {
            Some((index, instance)) => Picked::Instance(Pick {
                index,
                instance: Arc::clone(instance),
                booking: None,
                route: None,
            }),
            None => Picked::Nothing,
        },
        Picker::Kv { router, request } => {
            let choice = router.choose(
                instances,
                request,
                excluded,
                now_millis(),
                &mut rand::thread_rng(),
            );
            match choice {
                Choice::Picked(decision) => {
                    let Some(instance) = instances.get(decision.index) else {
                        return Picked::Nothing;
                    };
                    let booking = router.commit(&decision, request, Instant::now());
                    Picked::Instance(Pick {
                        index: decision.index,
                        route: Some(route_header(instance.url().as_str(), &decision, request)),
                        instance: Arc::clone(instance),
                        booking: Some(booking),
                    })
                }
                Choice::AllBusy => Picked::Busy,
                Choice::NoneEligible => Picked::Nothing,
            }
        }
    }
}

/// The 503 for a model whose instances are all busy.
fn overloaded(pool: &ModelPool, reason: &'static str) -> ApiError {
    ApiError::Overloaded {
        model: pool.name().to_string(),
        reason,
        retry_after_secs: BUSY_RETRY_AFTER_SECS,
    }
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

/// Forwards the request to `pool` and relays the answer to `client`. Returns whether the
/// client connection is still in a reusable state.
pub(crate) async fn forward<D: Downstream>(
    state: &State,
    client: &mut D,
    pool: &Arc<ModelPool>,
    body: Bytes,
    picker: Picker<'_>,
    exchange: &mut Exchange,
) -> bool {
    let _in_flight = GaugeGuard::new(&pool.metrics().in_flight);
    let instances = pool.instances();
    if let Picker::Kv { router, .. } = &picker {
        let admitted = tokio::select! {
            biased;
            admitted = router.admit(&instances, now_millis) => admitted,
            () = client.gone() => {
                exchange.client_gone = true;
                return false;
            }
        };
        if let Err(rejected) = admitted {
            let error = overloaded(pool, rejected.describe());
            return client.reject(exchange, &state.metrics, &error).await;
        }
    }
    let mut excluded = Excluded::default();
    let mut attempts_left = state.limits.retries.saturating_add(1);
    let mut stale_retries_left = STALE_CONNECTION_RETRIES;
    let mut last_failure: Option<String> = None;
    loop {
        let pick = match pick(&instances, &picker, &excluded) {
            Picked::Instance(pick) => pick,
            Picked::Busy => {
                if let Picker::Kv { router, .. } = &picker {
                    router.count_busy_rejection();
                }
                let error = overloaded(pool, "every remaining instance is busy");
                return client.reject(exchange, &state.metrics, &error).await;
            }
            Picked::Nothing => {
                let error = match last_failure {
                    None => ApiError::NoHealthyInstance {
                        model: pool.name().to_string(),
                        retry_after_secs: pool.retry_after_secs(state.health_interval_ms),
                    },
                    Some(detail) => ApiError::UpstreamUnavailable { detail },
                };
                return client.reject(exchange, &state.metrics, &error).await;
            }
        };
        let Pick {
            index,
            instance,
            booking,
            route,
        } = pick;
        exchange.instance = Some(instance.instance_header().clone());
        exchange.kv_route.clone_from(&route);
        let in_flight = instance.start_request();
        match attempt(state, client, &instance, &body, &exchange.request_id).await {
            Ok(upstream) => {
                let answer = Answer {
                    instance: &instance,
                    route: route.as_ref(),
                    booking: booking.as_ref(),
                };
                let reusable = respond(state, client, pool, answer, upstream, exchange).await;
                drop(in_flight);
                return reusable;
            }
            Err(AttemptError::Retryable {
                kind,
                detail,
                reused,
            }) => {
                drop(in_flight);
                drop(booking);
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
                    return client.reject(exchange, &state.metrics, &error).await;
                }
            }
            Err(AttemptError::Timeout) => {
                drop(in_flight);
                instance.record_failure(FailureKind::Timeout, &state.outlier, now_millis());
                return client
                    .reject(exchange, &state.metrics, &ApiError::UpstreamTimeout)
                    .await;
            }
            Err(AttemptError::Unforwardable(detail)) => {
                drop(in_flight);
                let error = ApiError::UpstreamUnavailable { detail };
                return client.reject(exchange, &state.metrics, &error).await;
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
async fn attempt<D: Downstream>(
    state: &State,
    client: &mut D,
    instance: &Instance,
    body: &Bytes,
    request_id: &HeaderValue,
) -> Result<UpstreamSession, AttemptError> {
    let target = UpstreamTarget {
        host: instance.host_header(),
        body_len: body.len(),
        request_id,
    };
    match instance.h1_address() {
        Some(address) => attempt_h1(state, client, instance, address, body, &target).await,
        None => attempt_pingora(state, client, instance, body, &target).await,
    }
}

/// Runs `exchange` (sending the request and reading the response head) within the
/// first-byte timeout, unless the client leaves first.
async fn within_first_byte<D: Downstream, T>(
    state: &State,
    client: &mut D,
    exchange: impl Future<Output = T>,
) -> Result<T, AttemptError> {
    unless_client_leaves(client, timeout(state.limits.first_byte_timeout, exchange))
        .await?
        .map_err(|_| AttemptError::Timeout)
}

/// Runs `work` unless the client leaves first.
async fn unless_client_leaves<D: Downstream, T>(
    client: &mut D,
    work: impl Future<Output = T>,
) -> Result<T, AttemptError> {
    tokio::select! {
        biased;
        output = work => Ok(output),
        () = client.gone() => Err(AttemptError::ClientGone),
    }
}

/// A failed connect to `instance`: retryable elsewhere.
fn connect_failed(instance: &Instance, error: impl std::fmt::Display) -> AttemptError {
    AttemptError::Retryable {
        kind: FailureKind::Connect,
        detail: format!("connect to {}: {error}", instance.url()),
        reused: false,
    }
}

/// [`attempt`] on our HTTP/1.1 client: head and body in one write.
async fn attempt_h1<D: Downstream>(
    state: &State,
    client: &mut D,
    instance: &Instance,
    address: std::net::SocketAddr,
    body: &Bytes,
    target: &UpstreamTarget<'_>,
) -> Result<UpstreamSession, AttemptError> {
    let pool = state.upstream.h1();
    let (mut upstream, reused) = Roundtrip::open(pool, address, instance.connect_timeout())
        .await
        .map_err(|error| connect_failed(instance, error))?;
    client
        .write_upstream_request(target, upstream.request_head())
        .map_err(|error| AttemptError::Unforwardable(error.to_string()))?;
    // The first-byte deadline runs on the connection's own timer.
    let exchange = upstream.request(body, state.limits.first_byte_timeout);
    match unless_client_leaves(client, exchange).await? {
        Err(TimedOut) => Err(AttemptError::Timeout),
        Ok(Err(error)) => Err(AttemptError::Retryable {
            kind: match error {
                RoundtripError::Connect(_) => FailureKind::Connect,
                RoundtripError::Broken(_) => FailureKind::Reset,
            },
            detail: format!("{} before the response: {error}", instance.url()),
            reused,
        }),
        Ok(Ok(())) => Ok(UpstreamSession::H1(upstream)),
    }
}

/// [`attempt`] on pingora's client (h2c and `https://` engines).
async fn attempt_pingora<D: Downstream>(
    state: &State,
    client: &mut D,
    instance: &Instance,
    body: &Bytes,
    target: &UpstreamTarget<'_>,
) -> Result<UpstreamSession, AttemptError> {
    let request = client
        .upstream_request(target)
        .map_err(|error| AttemptError::Unforwardable(error.to_string()))?;
    let (mut upstream, reused) = state
        .upstream
        .session(instance.peer())
        .await
        .map_err(|error| connect_failed(instance, error))?;
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
    match within_first_byte(state, client, exchange).await? {
        Err(error) => {
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
        Ok(()) => Ok(UpstreamSession::Pingora(Box::new(upstream))),
    }
}

/// The instance that answers, and what the response needs to know about the decision.
pub(crate) struct Answer<'a> {
    /// The instance.
    pub(crate) instance: &'a Instance,
    /// `x-kvmesh-route` (`policy: kv` only).
    pub(crate) route: Option<&'a HeaderValue>,
    /// The load `policy: kv` booked for the request.
    pub(crate) booking: Option<&'a Booking<'a>>,
}

/// Judges the engine's response status, has `client` relay the answer, then returns the
/// upstream connection to the pool or counts the engine's failure.
async fn respond<D: Downstream>(
    state: &State,
    client: &mut D,
    pool: &ModelPool,
    answer: Answer<'_>,
    mut upstream: UpstreamSession,
    exchange: &mut Exchange,
) -> bool {
    let instance = answer.instance;
    let Some(status) = upstream.status() else {
        return false;
    };
    exchange.status = status;
    if status >= 500 {
        instance.record_failure(FailureKind::Status5xx, &state.outlier, now_millis());
    } else {
        instance.record_success();
    }
    match client
        .relay(state, pool, &answer, &mut upstream, exchange)
        .await
    {
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

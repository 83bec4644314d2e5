//! One engine instance and all of its live state, in one place: health,
//! ejection, in-flight count and its discovery state, each an atomic (no lock on
//! the hot path).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use kvmesh_config::{BackendUrl, Protocol, Role};
use kvmesh_route::Candidate;
use pingora_core::upstreams::peer::HttpPeer;
use tokio::sync::watch;

use crate::engines::outlier::{OutlierPolicy, OutlierState};
use crate::engines::protocol::sglang::DEFAULT_BOOTSTRAP_PORT;
use crate::metrics::failure::FailureKind;
use crate::metrics::families::InstanceMetrics;

/// Concurrent h2 streams per upstream h2c connection.
const MAX_H2_STREAMS: usize = 128;

/// Per-attempt connection settings shared by every instance.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PeerSettings {
    /// TCP connect timeout.
    pub(crate) connect_timeout: Duration,
}

/// Where an instance stands in its discovery source's eyes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Membership {
    /// Takes requests (a static backend always is).
    Ready = 0,
    /// Registered, but its engine is unhealthy: no new requests.
    NotReady = 1,
    /// Shutting down: in-flight requests finish, no new ones.
    Draining = 2,
    /// Gone from discovery: no new requests, its background tasks stop.
    Removed = 3,
}

impl Membership {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Ready,
            1 => Self::NotReady,
            2 => Self::Draining,
            _ => Self::Removed,
        }
    }

    /// The label used in `/health` and logs.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::NotReady => "not_ready",
            Self::Draining => "draining",
            Self::Removed => "removed",
        }
    }
}

/// How an instance left discovery, which decides what becomes of its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Departure {
    /// It was draining first (its agent shuts down, its engine goes next): its streams
    /// continue on another instance at once.
    Drained,
    /// Its record vanished while it served (a registry lease that expired under load, a
    /// deleted key): its engine may well still be streaming, so its streams stay while
    /// tokens flow and continue elsewhere only once they stall.
    Vanished,
}

/// An engine instance serving one model.
#[derive(Debug)]
pub(crate) struct Instance {
    /// Stable id: the worker id in the KV index (a static backend's position in its
    /// model's `backends`, a discovered instance's agent-chosen id).
    id: u64,
    url: BackendUrl,
    peer: HttpPeer,
    /// The address of a plaintext HTTP/1.1 engine (spoken to by our own client).
    h1_address: Option<SocketAddr>,
    /// `x-kvmesh-instance` value (shared bytes: cloning is a refcount).
    instance_header: HeaderValue,
    /// `Host` value sent upstream.
    host_header: HeaderValue,
    in_flight: AtomicU64,
    healthy: AtomicBool,
    membership: AtomicU8,
    outlier: OutlierState,
    metrics: InstanceMetrics,
    /// Set once discovery removed (or replaced) it, with how: the streams still relayed
    /// from it continue elsewhere at once, or once they stall.
    left: watch::Sender<Option<Departure>>,
    /// Its side of disaggregated serving.
    role: Role,
    /// The model's pool it belongs to.
    pool: Option<Arc<str>>,
    /// Its engine's data-parallel ranks (1: one engine core).
    dp_ranks: u32,
    /// Its SGLang bootstrap port (a prefill engine's `--disaggregation-bootstrap-port`).
    bootstrap_port: u16,
}

impl Candidate for Instance {
    #[inline]
    fn id(&self) -> u64 {
        Instance::id(self)
    }

    #[inline]
    fn url(&self) -> &str {
        Instance::url(self).as_str()
    }

    #[inline]
    fn in_flight(&self) -> u64 {
        Instance::in_flight(self)
    }

    #[inline]
    fn is_available(&self, now_ms: u64) -> bool {
        Instance::is_available(self, now_ms)
    }

    fn pool(&self) -> Option<&str> {
        Instance::pool(self)
    }

    fn decodes(&self) -> bool {
        self.role().decodes()
    }
}

impl Instance {
    /// Instance `id` at `address` (the resolved `url`), ready and healthy until discovery or
    /// a probe says otherwise.
    pub(crate) fn new(
        id: u64,
        url: BackendUrl,
        address: SocketAddr,
        protocol: Protocol,
        settings: PeerSettings,
        metrics: InstanceMetrics,
        role: Role,
    ) -> Self {
        // `https://` engines: TLS with the host as SNI and the name checked.
        let sni = url.host().trim_start_matches('[').trim_end_matches(']');
        let mut peer = HttpPeer::new(address, url.is_tls(), sni.to_string());
        peer.options.connection_timeout = Some(settings.connect_timeout);
        if protocol == Protocol::H2c {
            peer.options.set_http_version(2, 2);
            peer.options.max_h2_streams = MAX_H2_STREAMS;
        }
        let h1_address = (!url.is_tls() && protocol != Protocol::H2c).then_some(address);
        let instance_header = shared_header(url.as_str());
        let host_header = shared_header(url.authority());
        Self {
            id,
            url,
            peer,
            h1_address,
            instance_header,
            host_header,
            in_flight: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            membership: AtomicU8::new(Membership::Ready as u8),
            outlier: OutlierState::default(),
            left: watch::channel(None).0,
            metrics,
            role,
            pool: None,
            dp_ranks: 1,
            bootstrap_port: DEFAULT_BOOTSTRAP_PORT,
        }
    }

    /// Its stable id (the KV index's worker id).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Its discovery state.
    pub(crate) fn membership(&self) -> Membership {
        Membership::from_u8(self.membership.load(Ordering::Relaxed))
    }

    /// Set by discovery.
    pub(crate) fn set_membership(&self, membership: Membership) {
        self.membership.store(membership as u8, Ordering::Relaxed);
    }

    /// Discovery removed or replaced it: marks it removed and wakes every
    /// [`Instance::left`] waiter, telling them whether it was draining first.
    pub(crate) fn leave(&self) {
        let before = self
            .membership
            .swap(Membership::Removed as u8, Ordering::Relaxed);
        let departure = if Membership::from_u8(before) == Membership::Draining {
            Departure::Drained
        } else {
            Departure::Vanished
        };
        self.left.send_if_modified(|left| {
            let first = left.is_none();
            left.get_or_insert(departure);
            first
        });
    }

    /// Resolves once discovery removed or replaced the instance (at once if it has), with
    /// how it left.
    pub(crate) async fn left(&self) -> Departure {
        let mut left = self.left.subscribe();
        let departure = left.wait_for(Option::is_some).await.ok().and_then(|d| *d);
        match departure {
            Some(departure) => departure,
            // The sender lives as long as `self`: never reached, but never a false alarm.
            None => std::future::pending().await,
        }
    }

    /// Its side of disaggregated serving.
    pub(crate) fn role(&self) -> Role {
        self.role
    }

    /// The model's pool it belongs to.
    pub(crate) fn pool(&self) -> Option<&str> {
        self.pool.as_deref()
    }

    /// This instance in `pool`.
    pub(crate) fn in_pool(mut self, pool: Option<String>) -> Self {
        self.pool = pool.map(Arc::from);
        self
    }

    /// This instance, whose engine runs `dp_ranks` data-parallel ranks.
    pub(crate) fn with_dp_ranks(mut self, dp_ranks: u32) -> Self {
        self.dp_ranks = dp_ranks.max(1);
        self
    }

    /// Its engine's data-parallel ranks.
    pub(crate) fn dp_ranks(&self) -> u32 {
        self.dp_ranks
    }

    /// This instance, whose SGLang bootstrap server listens on `port` (`None`: SGLang's
    /// default).
    pub(crate) fn with_bootstrap_port(mut self, port: Option<u16>) -> Self {
        self.bootstrap_port = port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
        self
    }

    /// Its SGLang bootstrap port.
    pub(crate) fn bootstrap_port(&self) -> u16 {
        self.bootstrap_port
    }

    /// The configured URL (`http://host:port`).
    pub(crate) fn url(&self) -> &BackendUrl {
        &self.url
    }

    /// Where to connect.
    pub(crate) fn peer(&self) -> &HttpPeer {
        &self.peer
    }

    /// The address of a plaintext HTTP/1.1 engine; `None` for h2c and `https://` engines.
    pub(crate) fn h1_address(&self) -> Option<SocketAddr> {
        self.h1_address
    }

    /// How long connecting to the engine may take.
    pub(crate) fn connect_timeout(&self) -> Option<std::time::Duration> {
        self.peer.options.connection_timeout
    }

    /// `x-kvmesh-instance` header value.
    pub(crate) fn instance_header(&self) -> &HeaderValue {
        &self.instance_header
    }

    /// `Host` header value for upstream requests.
    pub(crate) fn host_header(&self) -> &HeaderValue {
        &self.host_header
    }

    /// Ready by discovery, healthy by its probes and not ejected.
    pub(crate) fn is_available(&self, now_ms: u64) -> bool {
        self.membership() == Membership::Ready
            && self.is_healthy()
            && !self.outlier.is_ejected(now_ms)
    }

    /// Healthy by its probes.
    pub(crate) fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Set by the health checker.
    pub(crate) fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }

    /// Whether passive outlier detection has it ejected.
    pub(crate) fn is_ejected(&self, now_ms: u64) -> bool {
        self.outlier.is_ejected(now_ms)
    }

    /// Milliseconds until its ejection ends (0 when not ejected).
    pub(crate) fn ejection_remaining_ms(&self, now_ms: u64) -> u64 {
        self.outlier.remaining_ms(now_ms)
    }

    /// Requests currently forwarded to it.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Counts a request in flight until the guard drops.
    pub(crate) fn start_request(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight { instance: self }
    }

    /// A response that shows the engine works (any status below 500).
    pub(crate) fn record_success(&self) {
        self.outlier.record_success();
    }

    /// A failed attempt: counted in metrics and towards ejection (an instance that left
    /// discovery only in metrics).
    pub(crate) fn record_failure(&self, kind: FailureKind, policy: &OutlierPolicy, now_ms: u64) {
        self.metrics.count_error(kind);
        if kind == FailureKind::Left {
            return;
        }
        if let Some(length) = self.outlier.record_failure(policy, now_ms) {
            tracing::warn!(
                instance = %self.url,
                ejected_for_ms = u64::try_from(length.as_millis()).unwrap_or(u64::MAX),
                "instance ejected after consecutive failures"
            );
        }
    }

    /// Counts an upstream error that does not count towards ejection.
    pub(crate) fn count_error(&self, kind: FailureKind) {
        self.metrics.count_error(kind);
    }

    /// Copies live state into the instance gauges (called before a scrape).
    pub(crate) fn refresh_gauges(&self, now_ms: u64, disaggregated: bool) {
        self.metrics.set_state(
            i64::try_from(self.in_flight()).unwrap_or(i64::MAX),
            self.is_available(now_ms),
            self.is_unused_prefill_only(disaggregated),
        );
    }

    /// Whether the instance takes no request at all: it only prefills (`--role prefill`)
    /// and its model is not `disaggregated`, so it never gets a prefill leg.
    pub(crate) fn is_unused_prefill_only(&self, disaggregated: bool) -> bool {
        !disaggregated && !self.role().decodes()
    }
}

/// A header value backed by shared bytes, so clones do not copy.
fn shared_header(text: &str) -> HeaderValue {
    HeaderValue::from_maybe_shared(Bytes::copy_from_slice(text.as_bytes()))
        .unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// One request in flight on an instance.
#[derive(Debug)]
pub(crate) struct InFlight<'a> {
    instance: &'a Instance,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.instance.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

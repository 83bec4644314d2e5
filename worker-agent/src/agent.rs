//! Starting and stopping an agent: the tasks, their wiring, and the drain sequence.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvmesh_control::{ControlError, EventBus, InstanceId, InstanceRecord, InstanceState, Registry};
use kvmesh_telemetry::Telemetry;
use opentelemetry::KeyValue;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::config::{AgentConfig, EngineKind};
use crate::core::Core;
use crate::engine::intake::Intake;
use crate::engine::trtllm::TrtllmIntake;
use crate::engine_facts::{EngineFacts, FactSource};
use crate::error::AgentError;
use crate::event_sources;
use crate::health;
use crate::http_client::EngineClient;
use crate::load;
use crate::metrics::AgentMetrics;
use crate::publish;
use crate::registration::Registration;
use crate::server::{self, Status};
use crate::sidecar::forward::{self, Inbound};
use crate::sidecar::pacer::Pacer;

/// Batches queued for the publisher before new ones are dropped (and replayed on request).
const PUBLISH_QUEUE: usize = 16_384;
/// How long shutdown waits for the `draining` state to reach the registry.
const DRAIN_WRITE_TIMEOUT: Duration = Duration::from_secs(3);

/// A running agent. Dropping it aborts every task without deregistering (like `kill -9`: the
/// lease expires); call [`AgentHandle::shutdown`] for a graceful stop.
#[derive(Debug)]
pub struct AgentHandle {
    instance_id: InstanceId,
    listen_addr: SocketAddr,
    /// Where the inbound sidecar listens, when it is on.
    inbound_addr: Option<SocketAddr>,
    metrics: AgentMetrics,
    desired: watch::Sender<InstanceState>,
    written: watch::Receiver<Option<InstanceState>>,
    stop_registration: watch::Sender<bool>,
    registration: Option<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
    drain: Duration,
    /// Span export (`--otlp-endpoint`), flushed by a graceful stop.
    telemetry: Option<Telemetry>,
}

impl AgentHandle {
    /// The instance id the agent registered.
    pub fn instance_id(&self) -> InstanceId {
        self.instance_id
    }

    /// Where its `/health` and `/metrics` listen.
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen_addr
    }

    /// Where its inbound sidecar listens (`None`: off).
    pub fn inbound_addr(&self) -> Option<SocketAddr> {
        self.inbound_addr
    }

    /// Its metrics.
    pub fn metrics(&self) -> &AgentMetrics {
        &self.metrics
    }

    /// The state now in the registry (`None`: not registered).
    pub fn registered_state(&self) -> Option<InstanceState> {
        *self.written.borrow()
    }

    /// Graceful stop: advertise `draining`, wait the drain period, revoke the lease (removing
    /// the record), then stop every task.
    pub async fn shutdown(mut self) {
        self.desired.send_replace(InstanceState::Draining);
        let mut written = self.written.clone();
        // The borrow `wait_for` returns holds the channel's read lock: drop it at once.
        let drained = tokio::time::timeout(
            DRAIN_WRITE_TIMEOUT,
            written.wait_for(|s| *s == Some(InstanceState::Draining)),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        if !drained {
            tracing::warn!("could not advertise draining; deregistering anyway");
        }
        tokio::time::sleep(self.drain).await;
        self.stop_registration.send_replace(true);
        if let Some(registration) = self.registration.take() {
            let _ = registration.await;
        }
        for task in &self.tasks {
            task.abort();
        }
        if let Some(telemetry) = self.telemetry.take() {
            telemetry.shutdown().await;
        }
    }
}

impl Drop for AgentHandle {
    fn drop(&mut self) {
        if let Some(registration) = &self.registration {
            registration.abort();
        }
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn validate(config: &AgentConfig) -> Result<(), AgentError> {
    let bad = |why: String| Err(AgentError::Config(why));
    if config.model.is_empty() {
        return bad("model must not be empty".into());
    }
    if config.block_size == Some(0) {
        return bad("block size must be at least 1".into());
    }
    if config.dp_ranks == 0 {
        return bad("dp ranks must be at least 1".into());
    }
    if !config.engine_url.starts_with("http://") {
        return bad(format!(
            "engine URL {:?} must start with http://",
            config.engine_url
        ));
    }
    if config.lease_ttl < Duration::from_secs(1) {
        return bad("lease TTL must be at least 1 s".into());
    }
    if config.load_interval.is_zero()
        || config.health_interval.is_zero()
        || config.kv_events_poll_interval.is_zero()
    {
        return bad("intervals must be greater than zero".into());
    }
    if let Some(tracing) = &config.tracing {
        if !tracing.otlp_endpoint.starts_with("http://") {
            return bad(format!(
                "OTLP endpoint {:?} must be http://HOST:PORT",
                tracing.otlp_endpoint
            ));
        }
        if !(0.0..=1.0).contains(&tracing.sampling_ratio) {
            return bad("the trace sampling ratio must be from 0 to 1".into());
        }
    }
    Ok(())
}

/// The block size to translate with: `flag` (`--block-size`), which must equal what the
/// `engine` states; else the engine's; else its kind's default.
fn block_size(
    flag: Option<usize>,
    engine: Option<usize>,
    kind: EngineKind,
) -> Result<usize, AgentError> {
    match (flag, engine) {
        (Some(flag), Some(engine)) if flag != engine => Err(AgentError::Config(format!(
            "--block-size {flag} differs from the engine's KV block size {engine}: block hashes \
             would never match; drop the flag or set it to {engine}"
        ))),
        (Some(size), _) | (None, Some(size)) => Ok(size),
        (None, None) => Ok(kind.default_block_size()),
    }
}

/// Starts an agent on `registry` and `bus` (etcd + NATS, or the in-process ones). Returns once
/// its listener is bound, every rank's engine socket is subscribed (found first at vLLM's
/// `/kv_event_sources` with `config.discover_kv_events`; for TensorRT-LLM: its first poll of
/// `POST /kv_cache_events` answered) and the instance is registered (or fails after
/// `config.startup_timeout`).
pub async fn start(
    config: AgentConfig,
    registry: Arc<dyn Registry>,
    bus: Arc<dyn EventBus>,
) -> Result<AgentHandle, AgentError> {
    validate(&config)?;
    let deadline = tokio::time::Instant::now() + config.startup_timeout;
    let engine = EngineClient::new(&config.engine_url);
    let sources = event_sources::resolve(&config, &engine, deadline).await?;
    let metrics = AgentMetrics::new()?;
    let ns = &config.namespace;
    let id = config.instance_id;
    let mut tasks = Vec::new();
    let telemetry = match &config.tracing {
        Some(settings) => {
            let process = vec![
                KeyValue::new("service.instance.id", id.to_string()),
                KeyValue::new("kvmesh.model", config.model.clone()),
            ];
            Some(Telemetry::start(
                settings,
                process,
                metrics.trace_spans.clone(),
            )?)
        }
        None => None,
    };
    let tracer = telemetry
        .as_ref()
        .map(|telemetry| telemetry.tracer("kvmesh-agent"));

    // What the engine states about itself: its adapters and KV cache shape.
    let facts = FactSource {
        engine: engine.clone(),
        kind: config.engine_kind,
        total_blocks_flag: config.total_blocks,
        metrics: metrics.clone(),
    };
    let (known, cache) = facts
        .read(&EngineFacts::default(), Duration::from_secs(1))
        .await;
    let block_size = block_size(
        config.block_size,
        cache.and_then(|c| c.block_size),
        config.engine_kind,
    )?;

    let (out_tx, out_rx) = mpsc::channel(PUBLISH_QUEUE);
    let core = Arc::new(
        Core::new(id, sources.dp_ranks, block_size, out_tx, metrics.clone())
            .map_err(|e| AgentError::Config(e.to_string()))?
            .with_tracer(tracer.clone()),
    );
    tasks.push(tokio::spawn(publish::publisher(
        bus.clone(),
        ns.event_subject(&config.model),
        out_rx,
        metrics.clone(),
        tracer.clone(),
    )));
    let requests = bus.serve(&ns.snapshot_subject(id)).await?;
    tasks.push(tokio::spawn(publish::resync_service(
        bus.clone(),
        requests,
        core.clone(),
        metrics.clone(),
    )));

    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| AgentError::Listen {
            addr: config.listen,
            source,
        })?;
    let listen_addr = listener.local_addr().map_err(|source| AgentError::Listen {
        addr: config.listen,
        source,
    })?;

    let mut subscribed = Vec::new();
    let (recovered, _) = watch::channel(0u64);
    for (rank, source) in sources.ranks.into_iter().enumerate() {
        let (tx, rx) = oneshot::channel();
        subscribed.push(rx);
        let intake = Intake {
            rank: rank as u32,
            endpoint: source.endpoint,
            replay_endpoint: source.replay_endpoint,
            topic: source.topic,
            layout: config.engine_kind.layout(),
            core: core.clone(),
            metrics: metrics.clone(),
        };
        tasks.push(tokio::spawn(intake.run(tx, recovered.subscribe())));
    }
    if config.engine_kind == EngineKind::Trtllm {
        let (tx, rx) = oneshot::channel();
        subscribed.push(rx);
        let intake = TrtllmIntake::new(block_size, core.clone(), metrics.clone());
        tasks.push(tokio::spawn(intake.run(
            engine.clone(),
            config.kv_events_poll_interval,
            tx,
        )));
    }
    for rx in subscribed {
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(())) => {}
            _ if config.engine_kind == EngineKind::Trtllm => {
                return Err(AgentError::Startup(format!(
                    "the engine's POST {}/kv_cache_events did not answer",
                    config.engine_url
                )));
            }
            _ => {
                return Err(AgentError::Startup(format!(
                    "engine KV event socket {} not reachable",
                    config.kv_events_endpoint
                )));
            }
        }
    }

    let healthy = health::probe(&engine, Duration::from_secs(1)).await;
    metrics.engine_healthy.set(i64::from(healthy));
    let initial = if healthy {
        InstanceState::Ready
    } else {
        InstanceState::NotReady
    };
    let (facts_tx, facts_rx) = watch::channel(known);
    let (desired, desired_rx) = watch::channel(initial);
    let (written_tx, written) = watch::channel(None);
    let (stop_registration, stop_rx) = watch::channel(false);
    let labels = config.labels.clone();
    let pacing = config.inbound.as_ref().and_then(|inbound| inbound.pacing);
    #[cfg(feature = "cuda")]
    let (labels, pacing) = probe_gpus(&config, labels, pacing).await;
    let inbound = match &config.inbound {
        None => None,
        Some(inbound) => {
            let bound = |source| AgentError::Listen {
                addr: inbound.listen,
                source,
            };
            let listener = TcpListener::bind(inbound.listen).await.map_err(bound)?;
            let addr = listener.local_addr().map_err(bound)?;
            Some((listener, addr))
        }
    };
    let inbound_addr = inbound.as_ref().map(|(_, addr)| *addr);
    // Proxies reach the engine through the sidecar when it is on.
    let url = match (&config.advertise_url, inbound_addr) {
        (Some(url), _) => url.clone(),
        (None, Some(addr)) if addr.ip().is_unspecified() => {
            return Err(AgentError::Config(
                "--inbound-listen on every interface needs --advertise-url (the pod's address)"
                    .into(),
            ));
        }
        (None, Some(addr)) => format!("http://{addr}"),
        (None, None) => config.engine_url.clone(),
    };
    let record = InstanceRecord {
        instance_id: id,
        model: config.model.clone(),
        url,
        protocol: "http1".to_owned(),
        block_size: u32::try_from(block_size)
            .map_err(|_| AgentError::Config("block size too large".into()))?,
        total_blocks: 0,
        dp_ranks: sources.dp_ranks,
        labels,
        adapters: Vec::new(),
        event_subject: ns.event_subject(&config.model),
        snapshot_subject: ns.snapshot_subject(id),
        state: initial,
        role: config.role,
    };
    let key = ns.instance_key(&config.model, id);
    // Listing the record's own key (its id is fixed-width: no other key starts with it).
    match registry.list(&key).await {
        // Refused credentials will not get better by retrying: say so now instead of after
        // the startup timeout (an unreachable registry is retried by the registration).
        Err(error @ ControlError::Refused { .. }) => {
            return Err(AgentError::Startup(format!(
                "the registry refused the agent: {error}"
            )));
        }
        // A record left by an earlier agent with this instance id (a fixed `--instance-id`
        // restarted before its lease ran out): remove it first, so that proxies see the
        // instance leave and come back and take its new batch numbering from a snapshot,
        // instead of dropping batches numbered from 1 again as already seen.
        Ok(listing) if listing.records.iter().any(|(existing, _)| *existing == key) => {
            tracing::info!(%key, "removing the record an earlier agent left under this instance id");
            if let Err(error) = registry.delete(&key).await {
                tracing::warn!(%key, %error, "cannot remove the earlier record");
            }
        }
        _ => {}
    }
    let registration = Registration {
        registry,
        key,
        record,
        facts: facts_rx,
        ttl: config.lease_ttl,
        metrics: metrics.clone(),
        tracer,
    };
    let registration = tokio::spawn(registration.run(desired_rx, written_tx, stop_rx));
    tasks.push(tokio::spawn(health::run(
        engine.clone(),
        config.health_interval,
        desired.clone(),
        recovered,
        metrics.clone(),
    )));
    tasks.push(tokio::spawn(facts.run(
        config.health_interval,
        block_size,
        facts_tx,
    )));
    let load_core = core.clone();
    let status = Arc::new(Status {
        instance_id: id,
        written: written.clone(),
        core,
        metrics: metrics.clone(),
    });
    tasks.push(tokio::spawn(server::serve(listener, status)));
    if let (Some((listener, _)), Some(settings)) = (inbound, &config.inbound) {
        let bytes_per_block = settings.kv_bytes_per_token * block_size as u64;
        let pacer = pacing.map(|pacing| Arc::new(Pacer::new(pacing, metrics.pacer.clone())));
        let forwarder = Inbound::new(
            &config.engine_url,
            pacer,
            bytes_per_block,
            metrics.inbound_requests.clone(),
        );
        tasks.push(tokio::spawn(forward::serve(listener, Arc::new(forwarder))));
    }
    let handle = AgentHandle {
        instance_id: id,
        listen_addr,
        inbound_addr,
        metrics: metrics.clone(),
        desired,
        written: written.clone(),
        stop_registration,
        registration: Some(registration),
        tasks,
        drain: config.drain,
        telemetry,
    };
    let mut registered = written;
    match tokio::time::timeout_at(deadline, registered.wait_for(Option::is_some)).await {
        Ok(Ok(_)) => {}
        _ => {
            return Err(AgentError::Startup(
                "could not register the instance".into(),
            ));
        }
    }
    let mut handle = handle;
    handle.tasks.push(tokio::spawn(load::run(
        engine,
        config.engine_kind,
        bus,
        ns.load_subject(&config.model),
        config.load_interval,
        metrics,
        load_core,
    )));
    Ok(handle)
}

/// Measures the pod's GPUs (off the reactor): their memory and copy bandwidths go into the
/// record's `labels`, and with `measured_rate` the slowest host-to-device bandwidth becomes
/// `pacing`'s rate. Without a GPU or driver, logs why and changes nothing.
#[cfg(feature = "cuda")]
async fn probe_gpus(
    config: &AgentConfig,
    mut labels: std::collections::BTreeMap<String, String>,
    mut pacing: Option<crate::sidecar::pacer::PacerSettings>,
) -> (
    std::collections::BTreeMap<String, String>,
    Option<crate::sidecar::pacer::PacerSettings>,
) {
    let reports = match tokio::task::spawn_blocking(crate::gpu::probe).await {
        Ok(Ok(reports)) => reports,
        Ok(Err(why)) => {
            tracing::warn!(%why, "no GPU measured");
            return (labels, pacing);
        }
        Err(error) => {
            tracing::warn!(%error, "the GPU probe failed");
            return (labels, pacing);
        }
    };
    for report in &reports {
        tracing::info!(?report, "GPU measured");
        labels.extend(report.labels());
    }
    let slowest = reports
        .iter()
        .map(|r| r.h2d_gbps)
        .fold(f64::INFINITY, f64::min);
    let measured = config.inbound.as_ref().is_some_and(|i| i.measured_rate);
    if let Some(pacing) = pacing.as_mut().filter(|_| measured && slowest.is_finite()) {
        pacing.rate_bytes_per_sec = slowest * 1e9;
    }
    (labels, pacing)
}

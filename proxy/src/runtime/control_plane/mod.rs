//! The proxy side of the control plane (docs/control-plane.md): discovery of instances from a
//! registry (etcd, or in process) and intake of KV events and load reports from an event bus
//! (NATS, or in process), both through the `kvmesh-control` traits.
//!
//! - [`membership`]: a registry watch → the model pools (instances join, change state, leave;
//!   models the config does not list come and go).
//! - [`intake`]: event batches → each `policy: kv` model's KV index, with per-instance
//!   sequence tracking ([`sequence`]) and resync; load reports → routing costs.
//! - [`decider`]: one model's link to its decider, the replica that routes for the others.
//! - [`metrics`]: `kvmesh_discovery_*`, `kvmesh_kv_events_*`, `kvmesh_kv_resyncs_total`, ….
//!
//! Startup: the registry is listed (and its watch opened) before the proxy announces
//! readiness, waiting up to `discovery.initial_sync_timeout`; the event bus is connected in
//! the background, so a proxy starts (in approximate mode) even while NATS is down.

mod clients;
mod decider;
pub(crate) mod intake;
mod key_usage;
pub(crate) mod membership;
pub(crate) mod metrics;
pub(crate) mod sequence;

pub(crate) use membership::{ReloadNotifier, ReloadWatch, Reloaded};

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use kvmesh_config::{Config, DiscoveryKind, EventsKind, HealthCheckConfig};
use kvmesh_control::{
    EtcdRegistry, EventBus, Namespace, NatsBus, NatsSettings, Registry, Watch, WatchEvent,
};
use prometheus::IntGauge;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::edge::error::ProxyError;
use crate::engines::pool_builder::PoolBuilder;
use crate::metrics::families::Metrics;
use crate::runtime::control_plane::intake::{Intake, IntakeInput, IntakeSettings};
use crate::runtime::control_plane::membership::{MembershipApplier, Spawner};
use crate::runtime::control_plane::metrics::ControlMetrics;
use crate::state::shared::State;

/// First pause before connecting to NATS again; doubles per failure.
const BUS_RETRY_FIRST: Duration = Duration::from_millis(250);
/// Longest pause between attempts to connect to NATS.
const BUS_RETRY_MAX: Duration = Duration::from_secs(5);

/// In-process control-plane backends handed to [`crate::Proxy::bind_with`] by a program that
/// embeds the proxy (the demo): the registry serves `discovery.kind: in_process`, the bus
/// `events.kind: in_process`. With `etcd` / `nats` the proxy makes its own clients.
#[derive(Clone, Default)]
pub struct ControlPlane {
    /// The registry agents register their instances in.
    pub registry: Option<Arc<dyn Registry>>,
    /// The bus agents publish KV events and load reports on.
    pub bus: Option<Arc<dyn EventBus>>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("registry", &self.registry.is_some())
            .field("bus", &self.bus.is_some())
            .finish()
    }
}

/// Where the intake gets its bus.
enum BusSource {
    /// Given (in process).
    Ready(Arc<dyn EventBus>),
    /// A NATS server, connected in the background.
    Nats(Box<NatsSettings>),
}

/// The event intake, waiting for [`ControlLoops::start`].
struct PendingIntake {
    source: BusSource,
    namespace: Namespace,
    inputs: mpsc::UnboundedReceiver<IntakeInput>,
    settings: IntakeSettings,
    metrics: ControlMetrics,
}

/// The control plane's background work, prepared by `bind` and started by `run`.
pub(crate) struct ControlLoops {
    discovery: Option<(MembershipApplier, Watch)>,
    intake: Option<PendingIntake>,
    /// Reloads that gave models new pools, for the discovery loop; the sender goes to the
    /// reloader ([`ControlLoops::reload_notifier`]).
    reloads: Option<(Option<ReloadNotifier>, ReloadWatch)>,
    /// `kvmesh_discovery_connected` (`None` for static backends).
    discovery_synced: Option<IntGauge>,
}

impl std::fmt::Debug for ControlLoops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlLoops")
            .field("discovery", &self.discovery.is_some())
            .field("intake", &self.intake.is_some())
            .finish()
    }
}

/// Whether `config` needs anything beyond its static backends.
pub(crate) fn is_dynamic(config: &Config) -> bool {
    config.discovery.kind != DiscoveryKind::Static
}

fn control_error(what: &str, error: impl std::fmt::Display) -> ProxyError {
    ProxyError::ControlPlane(format!("{what}: {error}"))
}

impl ControlLoops {
    /// Opens the registry watch and applies the records it lists (up to
    /// `discovery.initial_sync_timeout`), and prepares the event intake.
    pub(crate) async fn prepare(
        config: &Config,
        given: ControlPlane,
        builder: Arc<PoolBuilder>,
        metrics: &Metrics,
        state: &Arc<State>,
    ) -> Result<Self, ProxyError> {
        let registry: Arc<dyn Registry> = match config.discovery.kind {
            DiscoveryKind::Static => {
                return Ok(Self {
                    discovery: None,
                    intake: None,
                    reloads: None,
                    discovery_synced: None,
                });
            }
            DiscoveryKind::Etcd => Arc::new(
                EtcdRegistry::with_settings(&clients::etcd_settings(&config.discovery))
                    .map_err(|error| control_error("discovery", error))?,
            ),
            DiscoveryKind::InProcess => given.registry.clone().ok_or_else(|| {
                ProxyError::ControlPlane(
                    "discovery kind in_process needs a registry passed to Proxy::bind_with"
                        .to_string(),
                )
            })?,
        };
        let control_metrics = ControlMetrics::new(metrics)?;
        let discovery_synced = Some(control_metrics.discovery_connected.clone());
        let discovery_ns = Namespace::new(&config.discovery.namespace)
            .map_err(|error| control_error("discovery.namespace", error))?;
        let (intake, inputs) = match Self::intake_source(config, &given)? {
            Some(source) => {
                let (tx, rx) = mpsc::unbounded_channel();
                let pending = PendingIntake {
                    source,
                    namespace: Namespace::new(&config.events.namespace)
                        .map_err(|error| control_error("events.namespace", error))?,
                    inputs: rx,
                    settings: IntakeSettings {
                        resync_timeout: config.events.resync_timeout,
                        load_report_ttl: config.events.load_report_ttl,
                    },
                    metrics: control_metrics.clone(),
                };
                (Some(pending), Some(tx))
            }
            None => (None, None),
        };
        let mut applier = MembershipApplier::new(
            config,
            discovery_ns.clone(),
            builder,
            inputs,
            control_metrics,
        );
        let mut watch = registry.watch(&discovery_ns.instances_prefix());
        let deadline = tokio::time::Instant::now() + config.discovery.initial_sync_timeout;
        loop {
            match tokio::time::timeout_at(deadline, watch.next()).await {
                Ok(Some(WatchEvent::Synced)) => {
                    applier.apply(state, WatchEvent::Synced).await;
                    break;
                }
                Ok(Some(event)) => applier.apply(state, event).await,
                Ok(None) => {
                    return Err(ProxyError::ControlPlane(
                        "the discovery registry closed its watch".to_string(),
                    ));
                }
                Err(_) => {
                    tracing::warn!(
                        timeout_ms =
                            u64::try_from(config.discovery.initial_sync_timeout.as_millis())
                                .unwrap_or(u64::MAX),
                        "discovery did not list its instances in time: starting without them"
                    );
                    break;
                }
            }
        }
        let (notifier, reloads) = watch::channel(None);
        Ok(Self {
            discovery: Some((applier, watch)),
            intake,
            reloads: Some((Some(notifier), reloads)),
            discovery_synced,
        })
    }

    /// Where the reloader announces states whose models got new pools (`None` without
    /// discovery); taken once.
    pub(crate) fn reload_notifier(&mut self) -> Option<ReloadNotifier> {
        self.reloads
            .as_mut()
            .and_then(|(notifier, _)| notifier.take())
    }

    /// 1 once discovery has listed its instances, 0 while its watch is down (`None` for
    /// static backends: nothing to wait for).
    pub(crate) fn discovery_synced(&self) -> Option<IntGauge> {
        self.discovery_synced.clone()
    }

    fn intake_source(
        config: &Config,
        given: &ControlPlane,
    ) -> Result<Option<BusSource>, ProxyError> {
        Ok(match config.events.kind {
            EventsKind::None => None,
            EventsKind::Nats => {
                let namespace = Namespace::new(&config.events.namespace)
                    .map_err(|error| control_error("events.namespace", error))?;
                Some(BusSource::Nats(Box::new(clients::nats_settings(
                    &config.events,
                    &namespace,
                ))))
            }
            EventsKind::InProcess => {
                Some(BusSource::Ready(given.bus.clone().ok_or_else(|| {
                    ProxyError::ControlPlane(
                        "events kind in_process needs a bus passed to Proxy::bind_with".to_string(),
                    )
                })?))
            }
        })
    }

    /// Starts the discovery watch and the intake (with the sharing of API key usage between
    /// replicas) in `tasks`; new instances get health probes with `health_check` (when on).
    /// `states` is the current state, `state` the one it holds now.
    pub(crate) fn start(
        self,
        states: &Arc<ArcSwap<State>>,
        state: &Arc<State>,
        health_check: Option<Arc<HealthCheckConfig>>,
        tasks: &mut JoinSet<()>,
    ) {
        if let Some((mut applier, mut watch)) = self.discovery {
            applier.start_spawning(Spawner {
                health_check,
                tasks: JoinSet::new(),
            });
            let mut state = Arc::clone(state);
            let mut reloads = self.reloads.map(|(_, reloads)| reloads);
            tasks.spawn(async move {
                loop {
                    tokio::select! {
                        event = watch.next() => match event {
                            Some(event) => applier.apply(&state, event).await,
                            None => return,
                        },
                        reloaded = next_reload(&mut reloads) => match reloaded {
                            Some(reloaded) => {
                                applier.rehome(&state, &reloaded).await;
                                state = reloaded.state;
                            }
                            // The reloader is gone: only watch events from now on.
                            None => reloads = None,
                        },
                    }
                }
            });
        }
        if let Some(intake) = self.intake {
            tasks.spawn(run_intake(intake, Arc::clone(states)));
        }
    }
}

/// The next state a reload announced; `None` once the reloader is gone; pending forever
/// without one.
async fn next_reload(reloads: &mut Option<ReloadWatch>) -> Option<Reloaded> {
    let Some(receiver) = reloads else {
        return std::future::pending().await;
    };
    loop {
        receiver.changed().await.ok()?;
        if let Some(reloaded) = receiver.borrow_and_update().clone() {
            return Some(reloaded);
        }
    }
}

/// Connects the bus (NATS: retrying in the background), subscribes, then runs the intake and
/// the sharing of API key usage with the other replicas.
async fn run_intake(pending: PendingIntake, states: Arc<ArcSwap<State>>) {
    let PendingIntake {
        source,
        namespace,
        inputs,
        settings,
        metrics,
    } = pending;
    let bus: Arc<dyn EventBus> = match source {
        BusSource::Ready(bus) => bus,
        BusSource::Nats(settings) => {
            let mut backoff = BUS_RETRY_FIRST;
            loop {
                match NatsBus::connect_with(&settings).await {
                    Ok(bus) => break Arc::new(bus),
                    Err(error) => {
                        tracing::warn!(url = %settings.url, %error, "cannot reach NATS: approximate routing until it answers");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(BUS_RETRY_MAX);
                    }
                }
            }
        }
    };
    // Before the intake: once it reads events, the other replicas' key usage reaches this one.
    let sharing = key_usage::subscribe(Arc::clone(&bus), &namespace, states, metrics.clone()).await;
    let mut backoff = BUS_RETRY_FIRST;
    let mut inputs = Some(inputs);
    let intake = loop {
        let Some(rx) = inputs.take() else {
            return;
        };
        match Intake::subscribe(Arc::clone(&bus), &namespace, rx, settings, metrics.clone()).await {
            Ok(intake) => break intake,
            Err((error, rx)) => {
                inputs = Some(rx);
                tracing::warn!(%error, "cannot subscribe to KV events; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BUS_RETRY_MAX);
            }
        }
    };
    tokio::join!(intake.run(), sharing.run());
}

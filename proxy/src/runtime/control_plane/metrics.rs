//! Metrics of discovery and event intake (registered with the proxy's other families).

use std::time::{SystemTime, UNIX_EPOCH};

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

use crate::metrics::families::{Metrics, MetricsError};
use crate::runtime::control_plane::sequence::ResyncReason;

/// Handles of the control plane's families.
#[derive(Debug, Clone)]
pub(crate) struct ControlMetrics {
    /// `kvmesh_discovery_instances{model}`.
    pub(crate) discovery_instances: IntGaugeVec,
    /// `kvmesh_discovery_errors_total`.
    pub(crate) discovery_errors: IntCounter,
    /// `kvmesh_discovery_connected`.
    pub(crate) discovery_connected: IntGauge,
    /// `kvmesh_kv_events_applied_total{model,status,event_type}`.
    pub(crate) events_applied: IntCounterVec,
    /// `kvmesh_kv_event_gaps_total{model}`.
    pub(crate) event_gaps: IntCounterVec,
    /// `kvmesh_kv_event_lag_seconds{model}`.
    event_lag: HistogramVec,
    /// `kvmesh_kv_resyncs_total{reason}`.
    resyncs: IntCounterVec,
    /// `kvmesh_kv_events_malformed_total{kind}`.
    malformed: IntCounterVec,
    /// `kvmesh_kv_event_batches_dropped_total{reason}`.
    dropped: IntCounterVec,
    /// `kvmesh_events_connected`.
    pub(crate) events_connected: IntGauge,
    /// `kvmesh_kv_index_source{model,mode}`.
    index_source: IntGaugeVec,
    /// `kvmesh_load_reports_total{model}`.
    pub(crate) load_reports: IntCounterVec,
}

/// What a malformed message was meant to be (the `kind` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Malformed {
    /// A KV event batch.
    Batch,
    /// A resync reply.
    Snapshot,
    /// A load report.
    Load,
    /// A session binding shared by another proxy replica.
    Session,
    /// In-flight load shared by another proxy replica.
    ReplicaLoad,
    /// A routing decision shared by another proxy replica.
    Decision,
    /// API key usage shared by another proxy replica.
    KeyUsage,
    /// A request another proxy replica sent this one as its model's decider.
    DecideRequest,
    /// The answer of this replica's model's decider.
    DecideAnswer,
}

impl Malformed {
    fn label(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Snapshot => "snapshot",
            Self::Load => "load",
            Self::Session => "session",
            Self::ReplicaLoad => "replica_load",
            Self::Decision => "decision",
            Self::KeyUsage => "key_usage",
            Self::DecideRequest => "decide_request",
            Self::DecideAnswer => "decide_answer",
        }
    }
}

/// Why a well-formed batch was not applied (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dropped {
    /// From an instance discovery does not list (or of a model not routed by `policy: kv`).
    UnknownInstance,
    /// Already applied, or covered by a snapshot.
    Stale,
    /// Never reached the intake: it fell a whole subscription buffer behind the bus.
    Overflow,
    /// Numbered past the last batch its instance's agent says it published: not the agent's.
    AheadOfAgent,
    /// From an instance whose engine runs another block size than its model (a batch or a
    /// snapshot): its blocks could never match, it is scored by predictions alone.
    BlockSizeMismatch,
    /// For a data-parallel rank its instance does not have (a batch, or a snapshot's event).
    UnknownRank,
}

impl Dropped {
    fn label(self) -> &'static str {
        match self {
            Self::UnknownInstance => "unknown_instance",
            Self::Stale => "stale",
            Self::UnknownRank => "unknown_rank",
            Self::Overflow => "overflow",
            Self::AheadOfAgent => "ahead_of_agent",
            Self::BlockSizeMismatch => "block_size_mismatch",
        }
    }
}

/// Buckets of `kvmesh_kv_event_lag_seconds`: 1 ms (its resolution) to a minute.
const LAG_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

impl ControlMetrics {
    /// Creates the families and registers them in `metrics`.
    pub(crate) fn new(metrics: &Metrics) -> Result<Self, MetricsError> {
        let discovery_instances = IntGaugeVec::new(
            Opts::new(
                "kvmesh_discovery_instances",
                "Instances discovery lists per model (every state).",
            ),
            &["model"],
        )?;
        let discovery_errors = IntCounter::new(
            "kvmesh_discovery_errors_total",
            "Discovery failures: lost connections to the store and unusable records.",
        )?;
        let discovery_connected = IntGauge::new(
            "kvmesh_discovery_connected",
            "1 while the discovery watch is connected and synced, else 0.",
        )?;
        let events_applied = IntCounterVec::new(
            Opts::new(
                "kvmesh_kv_events_applied_total",
                "KV events applied to the index, by outcome (ok, parent_not_found, block_not_found, invalid) and type.",
            ),
            &["model", "status", "event_type"],
        )?;
        let event_gaps = IntCounterVec::new(
            Opts::new(
                "kvmesh_kv_event_gaps_total",
                "Gaps detected in an instance's batch numbers (each triggers a resync).",
            ),
            &["model"],
        )?;
        let event_lag = HistogramVec::new(
            HistogramOpts::new(
                "kvmesh_kv_event_lag_seconds",
                "From an agent numbering a live KV event batch to this proxy's intake taking it \
                 (the agent's and the proxy's clocks: their skew adds), per model.",
            )
            .buckets(LAG_BUCKETS.to_vec()),
            &["model"],
        )?;
        let resyncs = IntCounterVec::new(
            Opts::new(
                "kvmesh_kv_resyncs_total",
                "Resync requests sent to agents, by reason.",
            ),
            &["reason"],
        )?;
        let malformed = IntCounterVec::new(
            Opts::new(
                "kvmesh_kv_events_malformed_total",
                "Control-plane messages that could not be decoded (batch, snapshot, load), skipped.",
            ),
            &["kind"],
        )?;
        let dropped = IntCounterVec::new(
            Opts::new(
                "kvmesh_kv_event_batches_dropped_total",
                "KV event batches not applied, by reason (unknown_instance, stale, overflow, ahead_of_agent, block_size_mismatch, unknown_rank).",
            ),
            &["reason"],
        )?;
        let events_connected = IntGauge::new(
            "kvmesh_events_connected",
            "1 while the event bus is connected, else 0.",
        )?;
        let index_source = IntGaugeVec::new(
            Opts::new(
                "kvmesh_kv_index_source",
                "policy kv: 1 for where overlaps come from now per model: events or approximate.",
            ),
            &["model", "mode"],
        )?;
        let load_reports = IntCounterVec::new(
            Opts::new(
                "kvmesh_load_reports_total",
                "Engine load reports folded into routing costs.",
            ),
            &["model"],
        )?;
        metrics.register(Box::new(discovery_instances.clone()))?;
        metrics.register(Box::new(discovery_errors.clone()))?;
        metrics.register(Box::new(discovery_connected.clone()))?;
        metrics.register(Box::new(events_applied.clone()))?;
        metrics.register(Box::new(event_gaps.clone()))?;
        metrics.register(Box::new(event_lag.clone()))?;
        metrics.register(Box::new(resyncs.clone()))?;
        metrics.register(Box::new(malformed.clone()))?;
        metrics.register(Box::new(dropped.clone()))?;
        metrics.register(Box::new(events_connected.clone()))?;
        metrics.register(Box::new(index_source.clone()))?;
        metrics.register(Box::new(load_reports.clone()))?;
        for reason in ResyncReason::ALL {
            resyncs.with_label_values(&[reason.label()]);
        }
        for kind in [Malformed::Batch, Malformed::Snapshot, Malformed::Load] {
            malformed.with_label_values(&[kind.label()]);
        }
        Ok(Self {
            discovery_instances,
            discovery_errors,
            discovery_connected,
            events_applied,
            event_gaps,
            event_lag,
            resyncs,
            malformed,
            dropped,
            events_connected,
            index_source,
            load_reports,
        })
    }

    /// Observes how late a live batch of `model` numbered at `at_ms` (Unix milliseconds, by
    /// its agent's clock) reached the intake; a clock ahead of this one counts as no lag.
    pub(crate) fn observe_lag(&self, model: &str, at_ms: u64) {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.event_lag
            .with_label_values(&[model])
            .observe(now_ms.saturating_sub(at_ms) as f64 / 1000.0);
    }

    /// Counts a resync request.
    pub(crate) fn resync(&self, reason: ResyncReason) {
        self.resyncs.with_label_values(&[reason.label()]).inc();
    }

    /// Counts a message that could not be decoded.
    pub(crate) fn malformed(&self, kind: Malformed) {
        self.malformed.with_label_values(&[kind.label()]).inc();
    }

    /// Counts batches not applied.
    pub(crate) fn dropped(&self, reason: Dropped, batches: u64) {
        if batches > 0 {
            self.dropped
                .with_label_values(&[reason.label()])
                .inc_by(batches);
        }
    }

    /// Sets where `model`'s overlaps come from.
    pub(crate) fn set_index_source(&self, model: &str, events: bool) {
        self.index_source
            .with_label_values(&[model, "events"])
            .set(i64::from(events));
        self.index_source
            .with_label_values(&[model, "approximate"])
            .set(i64::from(!events));
    }
}

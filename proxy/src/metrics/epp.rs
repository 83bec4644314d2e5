//! The endpoint picker's metric families (`kvmesh_epp_*`). The routing families
//! (`kvmesh_route_*`, `kvmesh_index_*`) count its decisions as they count the proxy's.

use prometheus::{
    Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry, exponential_buckets,
};

/// How the endpoint that served a request relates to the pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Served {
    /// The pick served it.
    Picked,
    /// One of the fallbacks named after the pick served it.
    Fallback,
    /// An instance of the model not named in the answer served it.
    Other,
    /// The gateway named an endpoint the model has no instance at.
    Unknown,
    /// The gateway's response carried no served endpoint.
    Unreported,
}

impl Served {
    fn label(self) -> &'static str {
        match self {
            Self::Picked => "picked",
            Self::Fallback => "fallback",
            Self::Other => "other",
            Self::Unknown => "unknown",
            Self::Unreported => "unreported",
        }
    }
}

/// The endpoint picker's families.
#[derive(Debug, Clone)]
pub(crate) struct EppMetrics {
    decisions: IntCounterVec,
    decision_seconds: Histogram,
    exchanges_in_flight: IntGauge,
    served: IntCounterVec,
    protocol_errors: IntCounterVec,
}

impl EppMetrics {
    /// Creates the families and registers them in `registry`.
    pub(crate) fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let decisions = IntCounterVec::new(
            Opts::new(
                "kvmesh_epp_decisions_total",
                "Requests the endpoint picker answered, by model and HTTP status (200: an \
                 endpoint picked; otherwise the status of the immediate response the gateway \
                 sent the client: 400/404/413 bad request, 429 shed, 503 no endpoint).",
            ),
            &["model", "status"],
        )?;
        let decision_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvmesh_epp_decision_seconds",
                "Time from the end of the request body to the pick's answer (model, \
                 tokenize, hash, queue, pick and fallbacks).",
            )
            .buckets(exponential_buckets(0.000_01, 2.5, 14)?),
        )?;
        let exchanges_in_flight = IntGauge::new(
            "kvmesh_epp_exchanges_in_flight",
            "ext_proc streams open (one per request through the gateway).",
        )?;
        let served = IntCounterVec::new(
            Opts::new(
                "kvmesh_epp_served_total",
                "Responses by where the gateway says they were served: picked, fallback, \
                 other (an instance not named), unknown (no instance there), unreported.",
            ),
            &["model", "endpoint"],
        )?;
        let protocol_errors = IntCounterVec::new(
            Opts::new(
                "kvmesh_epp_protocol_errors_total",
                "ext_proc streams ended by a message out of order (unexpected) or a body mode \
                 the picker cannot pick under (unsupported_mode).",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(decisions.clone()))?;
        registry.register(Box::new(decision_seconds.clone()))?;
        registry.register(Box::new(exchanges_in_flight.clone()))?;
        registry.register(Box::new(served.clone()))?;
        registry.register(Box::new(protocol_errors.clone()))?;
        for reason in ["unexpected", "unsupported_mode"] {
            protocol_errors.with_label_values(&[reason]);
        }
        Ok(Self {
            decisions,
            decision_seconds,
            exchanges_in_flight,
            served,
            protocol_errors,
        })
    }

    /// Counts a request answered with `status` for `model` (`""`: none resolved), taking
    /// `seconds` to decide.
    pub(crate) fn decided(&self, model: &str, status: u16, seconds: f64) {
        self.decisions
            .with_label_values(&[model, &status.to_string()])
            .inc();
        self.decision_seconds.observe(seconds);
    }

    /// Counts where a response of `model` was served.
    pub(crate) fn served(&self, model: &str, served: Served) {
        self.served
            .with_label_values(&[model, served.label()])
            .inc();
    }

    /// Counts a stream ended for a protocol error.
    pub(crate) fn protocol_error(&self, reason: &'static str) {
        self.protocol_errors.with_label_values(&[reason]).inc();
    }

    /// Counts an open stream until the guard drops.
    pub(crate) fn exchange(&self) -> OpenExchange {
        self.exchanges_in_flight.inc();
        OpenExchange(self.exchanges_in_flight.clone())
    }
}

/// One open ext_proc stream, counted while it lives.
#[derive(Debug)]
pub(crate) struct OpenExchange(IntGauge);

impl Drop for OpenExchange {
    fn drop(&mut self) {
        self.0.dec();
    }
}

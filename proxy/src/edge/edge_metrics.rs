//! Metrics of the edge: authentication, key limits, model concurrency limits,
//! HTTP/1.1 framing refused, TLS and config reloads. Registered once per process in the proxy's
//! registry; reloads resolve new label children from the same families.

use kvmesh_h1::strict::Violation;
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use crate::edge::auth::{AuthFailure, LIMITS, Limit};

/// The edge's metric families.
#[derive(Debug, Clone)]
pub(crate) struct EdgeMetrics {
    auth_rejections: IntCounterVec,
    rate_limited: IntCounterVec,
    key_tokens: IntCounterVec,
    key_shared: IntCounterVec,
    key_in_flight: IntGaugeVec,
    model_limit: IntGaugeVec,
    model_queue_depth: IntGaugeVec,
    model_queue_rejections: IntCounterVec,
    framing_rejections: IntCounterVec,
    tls_handshake_errors: IntCounterVec,
    tls_reloads: IntCounterVec,
    tls_expiry: IntGaugeVec,
    config_reloads: IntCounterVec,
    config_last_reload_ok: IntGauge,
}

impl EdgeMetrics {
    /// Creates the families and registers them in `registry`.
    pub(crate) fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let family = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(family.clone()))?;
            Ok::<_, prometheus::Error>(family)
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let family = IntGaugeVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(family.clone()))?;
            Ok::<_, prometheus::Error>(family)
        };
        let config_last_reload_ok = IntGauge::new(
            "kvmesh_config_last_reload_successful",
            "1 when the last config reload was applied (or none was tried), 0 when it was rejected.",
        )?;
        registry.register(Box::new(config_last_reload_ok.clone()))?;
        config_last_reload_ok.set(1);
        let framing_rejections = counter(
            "kvmesh_framing_rejections_total",
            "HTTP/1.1 messages refused for their framing, Host or target, by peer (client: \
             answered 400; engine: the response dropped, 502 when nothing was relayed yet) and \
             reason (content_length_and_transfer_encoding, transfer_encoding, content_length, \
             host, target, chunk).",
            &["peer", "reason"],
        )?;
        for peer in [Peer::Client, Peer::Engine] {
            for violation in Violation::ALL {
                framing_rejections.with_label_values(&[peer.label(), violation.label()]);
            }
        }
        Ok(Self {
            auth_rejections: counter(
                "kvmesh_auth_rejections_total",
                "Requests refused by API-key authentication, by reason (missing_key, invalid_key: 401; model_not_allowed: 403).",
                &["reason"],
            )?,
            rate_limited: counter(
                "kvmesh_rate_limited_total",
                "Requests answered 429 because their API key was over a limit, by key name and limit.",
                &["key", "limit"],
            )?,
            key_tokens: counter(
                "kvmesh_key_tokens_total",
                "Tokens charged to API keys with a tokens_per_minute limit, by key and kind (prompt, completion).",
                &["key", "kind"],
            )?,
            key_shared: counter(
                "kvmesh_key_shared_total",
                "What other proxy replicas' requests of an API key consumed, charged to this replica's limits, by key and kind (requests, tokens).",
                &["key", "kind"],
            )?,
            key_in_flight: gauge(
                "kvmesh_key_in_flight",
                "Requests in flight per API key.",
                &["key"],
            )?,
            model_limit: gauge(
                "kvmesh_model_concurrency_limit",
                "models[].concurrency.max_in_flight of models that have one.",
                &["model"],
            )?,
            model_queue_depth: gauge(
                "kvmesh_model_queue_depth",
                "Requests waiting for a slot under a model's concurrency limit.",
                &["model"],
            )?,
            model_queue_rejections: counter(
                "kvmesh_model_queue_rejections_total",
                "Requests answered 503 by a model's concurrency limit, by reason (queue_full, queue_timeout).",
                &["model", "reason"],
            )?,
            framing_rejections,
            tls_handshake_errors: counter(
                "kvmesh_tls_handshake_errors_total",
                "TLS handshakes on data listeners that failed, by listener and reason (error, timeout).",
                &["listener", "reason"],
            )?,
            tls_reloads: counter(
                "kvmesh_tls_certificate_reloads_total",
                "Certificate or key file changes of a TLS listener, by listener and result (ok, rejected).",
                &["listener", "result"],
            )?,
            tls_expiry: gauge(
                "kvmesh_tls_certificate_expiry_timestamp_seconds",
                "When the certificate a TLS listener serves expires (its notAfter), in Unix seconds, by listener.",
                &["listener"],
            )?,
            config_reloads: counter(
                "kvmesh_config_reloads_total",
                "Config reloads (SIGHUP, file change, POST /reload), by result (ok, rejected).",
                &["result"],
            )?,
            config_last_reload_ok,
        })
    }

    /// Handles of the authentication failures.
    pub(crate) fn auth(&self) -> AuthMetrics {
        AuthMetrics {
            missing: self.auth_rejections.with_label_values(&["missing_key"]),
            invalid: self.auth_rejections.with_label_values(&["invalid_key"]),
            model_not_allowed: self
                .auth_rejections
                .with_label_values(&["model_not_allowed"]),
        }
    }

    /// Handles of the API key `name`.
    pub(crate) fn key(&self, name: &str) -> KeyMetrics {
        KeyMetrics {
            limited: Limit::ALL
                .map(|limit| self.rate_limited.with_label_values(&[name, limit.label()])),
            prompt_tokens: self.key_tokens.with_label_values(&[name, "prompt"]),
            completion_tokens: self.key_tokens.with_label_values(&[name, "completion"]),
            shared_requests: self.key_shared.with_label_values(&[name, "requests"]),
            shared_tokens: self.key_shared.with_label_values(&[name, "tokens"]),
            in_flight: self.key_in_flight.with_label_values(&[name]),
        }
    }

    /// Handles of the concurrency limit of `model`, which is `limit`.
    pub(crate) fn model_limit(&self, model: &str, limit: u32) -> ModelLimitMetrics {
        self.model_limit
            .with_label_values(&[model])
            .set(i64::from(limit));
        ModelLimitMetrics {
            queue_depth: self.model_queue_depth.with_label_values(&[model]),
            queue_full: self
                .model_queue_rejections
                .with_label_values(&[model, "queue_full"]),
            queue_timeout: self
                .model_queue_rejections
                .with_label_values(&[model, "queue_timeout"]),
        }
    }

    /// Handles of the TLS listener `listener`.
    pub(crate) fn tls(&self, listener: &str) -> TlsMetrics {
        TlsMetrics {
            handshake_error: self
                .tls_handshake_errors
                .with_label_values(&[listener, "error"]),
            handshake_timeout: self
                .tls_handshake_errors
                .with_label_values(&[listener, "timeout"]),
            reload_ok: self.tls_reloads.with_label_values(&[listener, "ok"]),
            reload_rejected: self.tls_reloads.with_label_values(&[listener, "rejected"]),
            certificate_expiry: self.tls_expiry.with_label_values(&[listener]),
        }
    }

    /// Counts a message from `peer` refused for `violation`.
    pub(crate) fn count_framing(&self, peer: Peer, violation: Violation) {
        self.framing_rejections
            .with_label_values(&[peer.label(), violation.label()])
            .inc();
    }

    /// Counts a config reload.
    pub(crate) fn count_reload(&self, applied: bool) {
        let result = if applied { "ok" } else { "rejected" };
        self.config_reloads.with_label_values(&[result]).inc();
        self.config_last_reload_ok.set(i64::from(applied));
    }
}

/// Who sent a message the proxy refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer {
    /// A client's request.
    Client,
    /// An engine's response.
    Engine,
}

impl Peer {
    /// The metric label.
    fn label(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Engine => "engine",
        }
    }
}

/// Authentication failures.
#[derive(Debug, Clone)]
pub(crate) struct AuthMetrics {
    missing: IntCounter,
    invalid: IntCounter,
    model_not_allowed: IntCounter,
}

impl AuthMetrics {
    /// Counts a 401.
    pub(crate) fn count_failure(&self, failure: AuthFailure) {
        match failure {
            AuthFailure::Missing => self.missing.inc(),
            AuthFailure::Invalid => self.invalid.inc(),
        }
    }

    /// Counts a 403.
    pub(crate) fn count_model_not_allowed(&self) {
        self.model_not_allowed.inc();
    }
}

/// One API key's handles.
#[derive(Debug)]
pub(crate) struct KeyMetrics {
    limited: [IntCounter; LIMITS],
    prompt_tokens: IntCounter,
    completion_tokens: IntCounter,
    /// `kvmesh_key_shared_total{key,kind="requests"}`.
    pub(crate) shared_requests: IntCounter,
    /// `kvmesh_key_shared_total{key,kind="tokens"}` (a negative correction is not counted).
    pub(crate) shared_tokens: IntCounter,
    /// `kvmesh_key_in_flight{key}`.
    pub(crate) in_flight: IntGauge,
}

impl KeyMetrics {
    /// Counts a 429 for `limit`.
    pub(crate) fn count_limited(&self, limit: Limit) {
        if let Some(counter) = self.limited.get(limit as usize) {
            counter.inc();
        }
    }

    /// Counts charged tokens (a negative correction is not counted).
    pub(crate) fn count_tokens(&self, tokens: i64, completion: bool) {
        let Ok(tokens) = u64::try_from(tokens) else {
            return;
        };
        if completion {
            self.completion_tokens.inc_by(tokens);
        } else {
            self.prompt_tokens.inc_by(tokens);
        }
    }
}

/// One model's concurrency-limit handles.
#[derive(Debug)]
pub(crate) struct ModelLimitMetrics {
    /// `kvmesh_model_queue_depth{model}`.
    pub(crate) queue_depth: IntGauge,
    /// `kvmesh_model_queue_rejections_total{model,reason="queue_full"}`.
    pub(crate) queue_full: IntCounter,
    /// `kvmesh_model_queue_rejections_total{model,reason="queue_timeout"}`.
    pub(crate) queue_timeout: IntCounter,
}

/// One TLS listener's handles.
#[derive(Debug, Clone)]
pub(crate) struct TlsMetrics {
    /// Failed handshakes.
    pub(crate) handshake_error: IntCounter,
    /// Handshakes not finished within the client timeout.
    pub(crate) handshake_timeout: IntCounter,
    /// Certificate files reloaded.
    pub(crate) reload_ok: IntCounter,
    /// Certificate file changes that could not be used.
    pub(crate) reload_rejected: IntCounter,
    /// When the certificate in use expires (Unix seconds).
    pub(crate) certificate_expiry: IntGauge,
}

//! One API key: the models it may use and its limits.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvmesh_config::{ApiKeyConfig, Config};

use crate::edge::auth::bucket::TokenBucket;
use crate::edge::auth::meter::CompletionMeter;
use crate::edge::edge_metrics::KeyMetrics;

/// Seconds of requests a key's request bucket holds (its burst).
const REQUEST_BURST_SECS: f64 = 1.0;
/// Seconds of tokens a key's token bucket holds (its burst).
const TOKEN_BURST_SECS: f64 = 60.0;

/// A limit a key can run into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Limit {
    /// `requests_per_second`.
    RequestsPerSecond,
    /// `tokens_per_minute`.
    TokensPerMinute,
    /// `max_concurrency`.
    Concurrency,
}

/// Number of [`Limit`]s.
pub(crate) const LIMITS: usize = 3;

impl Limit {
    /// Every limit, in declaration order.
    pub(crate) const ALL: [Limit; LIMITS] = [
        Self::RequestsPerSecond,
        Self::TokensPerMinute,
        Self::Concurrency,
    ];

    /// The metric label (the config field's name).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::RequestsPerSecond => "requests_per_second",
            Self::TokensPerMinute => "tokens_per_minute",
            Self::Concurrency => "max_concurrency",
        }
    }
}

/// Why a key's request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyRejection {
    /// The key may not use this model (403).
    ModelNotAllowed,
    /// Over a limit (429), retry after this long.
    Limited(Limit, Duration),
}

/// A configured key with its live limits.
#[derive(Debug)]
pub(crate) struct ApiKey {
    settings: ApiKeyConfig,
    /// Canonical names of the models it may use (`None`: all).
    models: Option<HashSet<String>>,
    requests: Option<TokenBucket>,
    tokens: Option<TokenBucket>,
    /// Requests taken from `requests` and tokens charged to `tokens` on this replica since
    /// they were last shared with the other replicas ([`ApiKey::take_unshared`]).
    unshared_requests: AtomicU64,
    unshared_tokens: AtomicI64,
    in_flight: AtomicU32,
    metrics: KeyMetrics,
}

impl ApiKey {
    /// The key `settings` of `config` (whose aliases its `models` may use).
    pub(crate) fn new(
        settings: &ApiKeyConfig,
        config: &Config,
        metrics: KeyMetrics,
        now: Instant,
    ) -> Self {
        let models = (!settings.models.is_empty()).then(|| {
            config
                .models
                .iter()
                .filter(|model| {
                    settings
                        .models
                        .iter()
                        .any(|name| *name == model.name || model.aliases.contains(name))
                })
                .map(|model| model.name.clone())
                .collect()
        });
        let requests = settings
            .requests_per_second
            .map(|rate| TokenBucket::new(rate, (rate * REQUEST_BURST_SECS).max(1.0), now));
        let tokens = settings.tokens_per_minute.map(|per_minute| {
            let per_minute = per_minute as f64;
            TokenBucket::new(per_minute / 60.0, per_minute * TOKEN_BURST_SECS / 60.0, now)
        });
        Self {
            settings: settings.clone(),
            models,
            requests,
            tokens,
            unshared_requests: AtomicU64::new(0),
            unshared_tokens: AtomicI64::new(0),
            in_flight: AtomicU32::new(0),
            metrics,
        }
    }

    /// Its configuration (a reload keeps a key whose configuration is unchanged).
    pub(crate) fn settings(&self) -> &ApiKeyConfig {
        &self.settings
    }

    /// Admits a request for the model named `model` (canonical), or says why not.
    pub(crate) fn admit(
        self: &Arc<Self>,
        model: &str,
        now: Instant,
    ) -> Result<KeyPermit, KeyRejection> {
        if self
            .models
            .as_ref()
            .is_some_and(|models| !models.contains(model))
        {
            return Err(KeyRejection::ModelNotAllowed);
        }
        if let Some(tokens) = &self.tokens {
            tokens
                .check_positive(now)
                .map_err(|wait| self.limited(Limit::TokensPerMinute, wait))?;
        }
        let permit = self.enter()?;
        if let Some(requests) = &self.requests {
            requests
                .try_take(1.0, now)
                .map_err(|wait| self.limited(Limit::RequestsPerSecond, wait))?;
            self.unshared_requests.fetch_add(1, Ordering::Relaxed);
        }
        Ok(permit)
    }

    /// What this replica consumed since the last call, for the other replicas: requests
    /// taken and tokens charged (only those a limit counts).
    pub(crate) fn take_unshared(&self) -> (u64, i64) {
        (
            self.unshared_requests.swap(0, Ordering::Relaxed),
            self.unshared_tokens.swap(0, Ordering::Relaxed),
        )
    }

    /// Charges what another replica consumed (its [`ApiKey::take_unshared`]) to this
    /// replica's buckets, so the key's limits hold across the replicas.
    pub(crate) fn charge_shared(&self, requests: u64, tokens: i64, now: Instant) {
        if let Some(bucket) = &self.requests {
            bucket.charge(requests as f64, now);
            self.metrics.shared_requests.inc_by(requests);
        }
        if let Some(bucket) = &self.tokens {
            bucket.charge(tokens as f64, now);
            self.metrics
                .shared_tokens
                .inc_by(u64::try_from(tokens).unwrap_or(0));
        }
    }

    /// Takes a concurrency slot.
    fn enter(self: &Arc<Self>) -> Result<KeyPermit, KeyRejection> {
        if let Some(max) = self.settings.max_concurrency {
            let taken = self
                .in_flight
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max).then_some(n + 1)
                });
            if taken.is_err() {
                return Err(self.limited(Limit::Concurrency, Duration::ZERO));
            }
        } else {
            self.in_flight.fetch_add(1, Ordering::AcqRel);
        }
        self.metrics.in_flight.inc();
        Ok(KeyPermit {
            key: Arc::clone(self),
        })
    }

    fn limited(&self, limit: Limit, wait: Duration) -> KeyRejection {
        self.metrics.count_limited(limit);
        KeyRejection::Limited(limit, wait)
    }

    /// Charges `tokens` to the key's token bucket.
    pub(crate) fn charge(&self, tokens: i64, completion: bool, now: Instant) {
        if let Some(bucket) = &self.tokens {
            bucket.charge(tokens as f64, now);
            self.unshared_tokens.fetch_add(tokens, Ordering::Relaxed);
        }
        self.metrics.count_tokens(tokens, completion);
    }

    /// Whether it has a tokens-per-minute limit (completion tokens are metered).
    pub(crate) fn meters_tokens(&self) -> bool {
        self.tokens.is_some()
    }
}

/// One admitted request of a key: holds its concurrency slot until dropped.
#[derive(Debug)]
pub(crate) struct KeyPermit {
    key: Arc<ApiKey>,
}

impl KeyPermit {
    /// The key.
    pub(crate) fn key(&self) -> &Arc<ApiKey> {
        &self.key
    }

    /// Charges the request's prompt tokens.
    pub(crate) fn charge_prompt(&self, tokens: u64) {
        let tokens = i64::try_from(tokens).unwrap_or(i64::MAX);
        self.key.charge(tokens, false, Instant::now());
    }

    /// A meter that charges completion tokens as the response streams.
    pub(crate) fn completion_meter(&self) -> CompletionMeter {
        CompletionMeter::new(Arc::clone(&self.key))
    }
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        self.key.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.key.metrics.in_flight.dec();
    }
}

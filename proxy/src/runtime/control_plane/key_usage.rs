//! API key limits that hold across proxy replicas. Each replica refills a key's buckets at
//! the key's full rate, counts what it takes from them, and every [`SHARE_INTERVAL`]
//! publishes that on `{namespace}.key_usage`; every other replica charges it to the same
//! key's buckets. So the replicas together admit a key's `requests_per_second` and
//! `tokens_per_minute`, overshooting by at most what they admit within one interval before
//! they hear of each other (and each replica's burst once, at the start).

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use kvmesh_control::{EventBus, HexU64, Namespace, Subscription};
use serde::{Deserialize, Serialize};

use crate::runtime::control_plane::metrics::{ControlMetrics, Malformed};
use crate::state::shared::State;

/// How often a replica shares what its keys consumed.
pub(crate) const SHARE_INTERVAL: Duration = Duration::from_millis(100);

/// What one replica's keys consumed since its last message.
#[derive(Debug, Serialize, Deserialize)]
struct KeyUsage {
    /// The publishing replica (a random id; its own messages come back and are skipped).
    replica: HexU64,
    keys: Vec<KeyCharge>,
}

/// One key's consumption.
#[derive(Debug, Serialize, Deserialize)]
struct KeyCharge {
    /// The first 8 bytes of the key's SHA-256 (see [`crate::edge::auth::Authenticator::take_unshared`]).
    key: HexU64,
    /// Requests taken from its `requests_per_second` bucket.
    requests: u64,
    /// Tokens charged to its `tokens_per_minute` bucket.
    tokens: i64,
}

/// This replica's subscription to the others' key usage, ready to [`Sharing::run`].
pub(crate) struct Sharing {
    bus: Arc<dyn EventBus>,
    subject: String,
    incoming: Subscription,
    states: Arc<ArcSwap<State>>,
    metrics: ControlMetrics,
}

/// Subscribes to the other replicas' key usage (retrying until the bus takes it); `states` is
/// the current state (reloads replace it).
pub(crate) async fn subscribe(
    bus: Arc<dyn EventBus>,
    namespace: &Namespace,
    states: Arc<ArcSwap<State>>,
    metrics: ControlMetrics,
) -> Sharing {
    let subject = namespace.key_usage_subject();
    let incoming = loop {
        match bus.subscribe(&subject).await {
            Ok(subscription) => break subscription,
            Err(error) => {
                tracing::warn!(%error, "cannot subscribe to the replicas' key usage; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    Sharing {
        bus,
        subject,
        incoming,
        states,
        metrics,
    }
}

impl Sharing {
    /// Shares this replica's key consumption and charges the others' until the bus closes.
    pub(crate) async fn run(self) {
        let Self {
            bus,
            subject,
            mut incoming,
            states,
            metrics,
        } = self;
        let replica = HexU64(rand::random());
        let mut tick = tokio::time::interval(SHARE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let keys: Vec<KeyCharge> = states
                        .load()
                        .auth
                        .take_unshared()
                        .into_iter()
                        .map(|(key, requests, tokens)| KeyCharge { key: HexU64(key), requests, tokens })
                        .collect();
                    if keys.is_empty() {
                        continue;
                    }
                    let usage = KeyUsage { replica, keys };
                    let payload = serde_json::to_vec(&usage).unwrap_or_default();
                    // Best effort: a usage lost while the bus is down only loosens the limit.
                    if let Err(error) = bus.publish(&subject, Bytes::from(payload)).await {
                        tracing::debug!(%error, "cannot share key usage");
                    }
                }
                message = incoming.next() => {
                    let Some(message) = message else { return };
                    match serde_json::from_slice::<KeyUsage>(&message.payload) {
                        Ok(usage) if usage.replica != replica => {
                            let state = states.load();
                            let now = Instant::now();
                            for charge in usage.keys {
                                state.auth.charge_shared(charge.key.0, charge.requests, charge.tokens, now);
                            }
                        }
                        Ok(_) => {}
                        Err(error) => {
                            metrics.malformed(Malformed::KeyUsage);
                            tracing::debug!(%error, "malformed key usage");
                        }
                    }
                }
            }
        }
    }
}

//! The `events` section: where the proxy reads the engines' KV cache events (published by
//! the worker-agents) and their load reports.

use std::time::Duration;

use serde::Deserialize;

use crate::discovery::DEFAULT_NAMESPACE;
use crate::{ControlTlsConfig, NatsAuthConfig};

/// Which event bus carries KV events and load reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventsKind {
    /// No events: `policy: kv` predicts caches from its own decisions (approximate mode).
    #[default]
    None,
    /// A NATS server (`nats-server`): subjects `{namespace}.kv.{model}`,
    /// `{namespace}.load.{model}`, resync on `{namespace}.snapshot.{instance_id}`.
    Nats,
    /// An in-process bus passed in by the embedding program (the demo).
    InProcess,
}

impl EventsKind {
    /// The name used in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Nats => "nats",
            Self::InProcess => "in_process",
        }
    }
}

/// The `events` section. Needs `discovery.kind: etcd` or `in_process` (events name
/// instances by the id their agent registers).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EventsConfig {
    /// `none` (default), `nats` or `in_process`.
    pub kind: EventsKind,
    /// NATS server URLs, comma-separated (`nats://host:4222`, `tls://host:4222`); `kind:
    /// nats` only. Credentials go in `auth`, never in the URL.
    pub url: String,
    /// TLS towards NATS (a CA, a client certificate); absent: plaintext unless the URL is
    /// `tls://` or the server requires TLS.
    pub tls: Option<ControlTlsConfig>,
    /// NATS credentials, each secret read from a file.
    pub auth: NatsAuthConfig,
    /// Durable KV events on a JetStream stream (`kind: nats`; the server needs JetStream):
    /// the agents' batches are stored before they count as sent, and a proxy whose
    /// connection comes back replays what it missed instead of asking every agent again.
    pub jetstream: Option<JetStreamConfig>,
    /// Subject prefix (the first token of every subject). Letters, digits, `-`, `_`.
    pub namespace: String,
    /// Time allowed for an agent to answer a resync (snapshot) request before it is retried.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub resync_timeout: Duration,
    /// A load report older than this no longer counts in routing costs.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub load_report_ttl: Duration,
    /// How often the NATS client PINGs a server that sends nothing else; a server that
    /// hangs without closing the connection is given up within three of these.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub ping_interval: Duration,
}

impl Default for EventsConfig {
    fn default() -> Self {
        Self {
            kind: EventsKind::None,
            url: "nats://127.0.0.1:4222".to_string(),
            tls: None,
            auth: NatsAuthConfig::default(),
            jetstream: None,
            namespace: DEFAULT_NAMESPACE.to_string(),
            resync_timeout: Duration::from_secs(2),
            load_report_ttl: Duration::from_secs(5),
            ping_interval: Duration::from_secs(2),
        }
    }
}

/// `events.jetstream`: the stream that keeps KV event batches.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JetStreamConfig {
    /// The stream's name (made when missing, storing `{namespace}.kv.>`); the agents'
    /// `--nats-jetstream-stream` names the same one.
    pub stream: String,
    /// How long the stream keeps a batch (a proxy disconnected longer resyncs from the
    /// agents).
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub max_age: Duration,
}

impl Default for JetStreamConfig {
    fn default() -> Self {
        Self {
            stream: "KVMESH_KV_EVENTS".to_string(),
            max_age: Duration::from_secs(3600),
        }
    }
}

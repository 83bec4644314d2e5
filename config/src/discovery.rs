//! Where model instances come from besides the static `backends` lists: the `discovery`
//! section, and the defaults of models that discovery reports but the config does not list.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::{ControlTlsConfig, EtcdAuthConfig, KvRoutingConfig, PolicyKind};

/// The namespace every etcd key and NATS subject of kvmesh lives under by default.
pub const DEFAULT_NAMESPACE: &str = "kvmesh";

/// Which discovery source supplies instances at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryKind {
    /// Only the `backends` listed under each model, read at startup.
    #[default]
    Static,
    /// Instance records that worker-agents keep in etcd under a lease
    /// (`/{namespace}/instances/{model}/{instance_id}`), watched by the proxy.
    Etcd,
    /// An in-process registry passed in by the embedding program (the demo); not usable
    /// from the `kvmesh-proxy` binary.
    InProcess,
}

impl DiscoveryKind {
    /// The name used in the config file.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::Etcd => "etcd",
            Self::InProcess => "in_process",
        }
    }
}

/// The `discovery` section.
///
/// With `kind: etcd` or `in_process`, instances registered for a configured model join its
/// pool (a model may then list `backends: []`); instances of a model the config does not
/// list are served as a new model with `default_model`'s settings, while it has instances.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// `static` (default), `etcd` or `in_process`.
    pub kind: DiscoveryKind,
    /// The etcd endpoint (`http://host:port`, or `https://` with `tls`), or the members of
    /// one cluster separated by commas (calls move to the next member when one does not
    /// answer); `kind: etcd` only. A broken watch reconnects by itself (backoff from 100 ms
    /// doubling to 5 s) and re-lists.
    pub endpoint: String,
    /// TLS towards etcd: the CA that signs its members (required), a client certificate
    /// for etcd's `--client-cert-auth`.
    pub tls: Option<ControlTlsConfig>,
    /// etcd user / password auth.
    pub auth: Option<EtcdAuthConfig>,
    /// Key prefix: records live under `/{namespace}/instances/`. Letters, digits, `-`, `_`.
    pub namespace: String,
    /// How long startup waits for the first full listing of the records before the proxy
    /// starts serving without them (they are picked up as soon as the store answers).
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub initial_sync_timeout: Duration,
    /// Settings of discovered models that the config does not list.
    pub default_model: DefaultModelConfig,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            kind: DiscoveryKind::Static,
            endpoint: "http://127.0.0.1:2379".to_string(),
            tls: None,
            auth: None,
            namespace: DEFAULT_NAMESPACE.to_string(),
            initial_sync_timeout: Duration::from_secs(2),
            default_model: DefaultModelConfig::default(),
        }
    }
}

/// How a discovered model that the config does not list is served.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DefaultModelConfig {
    /// Serve such models at all (default true); when false their records are ignored.
    pub enabled: bool,
    /// Load-balancing policy; `null` (default): `kv` when `tokenizer` is set, else
    /// `round_robin`.
    pub policy: Option<PolicyKind>,
    /// Tokenizer directory used for every such model (`policy: kv`).
    pub tokenizer: Option<PathBuf>,
    /// Settings of `policy: kv`; `block_size` is taken from the first instance record of
    /// the model (the engine's own block size); set here, it is used only for a record that
    /// gives none (else 16).
    pub kv: KvRoutingConfig,
    /// Migrations per stream (see `models[].migration_limit`; `null`: the default).
    pub migration_limit: Option<u32>,
}

impl Default for DefaultModelConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            policy: None,
            tokenizer: None,
            kv: KvRoutingConfig::default(),
            migration_limit: None,
        }
    }
}

impl DefaultModelConfig {
    /// The policy such a model uses.
    pub fn effective_policy(&self) -> PolicyKind {
        self.policy.unwrap_or(if self.tokenizer.is_some() {
            PolicyKind::Kv
        } else {
            PolicyKind::RoundRobin
        })
    }
}

/// Whether `namespace` can be one etcd path segment and one NATS subject token.
pub(crate) fn valid_namespace(namespace: &str) -> bool {
    !namespace.is_empty()
        && namespace
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_model_policy_follows_the_tokenizer() {
        let mut model = DefaultModelConfig::default();
        assert_eq!(model.effective_policy(), PolicyKind::RoundRobin);
        model.tokenizer = Some(PathBuf::from("tok"));
        assert_eq!(model.effective_policy(), PolicyKind::Kv);
        model.policy = Some(PolicyKind::LeastRequest);
        assert_eq!(model.effective_policy(), PolicyKind::LeastRequest);
    }

    #[test]
    fn namespaces_are_one_token() {
        assert!(valid_namespace("kvmesh"));
        assert!(valid_namespace("prod-2_a"));
        for bad in ["", "a.b", "a/b", "a b", "a*", ">"] {
            assert!(!valid_namespace(bad), "{bad:?}");
        }
    }
}

//! Where a model's instances come from.
//!
//! The static list in the config, read once at startup. Instances from etcd or the
//! in-process registry arrive at run time through [`crate::runtime::control_plane`].

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

use kvmesh_config::{
    BackendUrl, Config, DisaggregationConfig, KvRoutingConfig, PolicyKind, PoolConfig, Protocol,
    Role,
};

use crate::edge::error::ProxyError;

/// One instance as a discovery source reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InstanceSpec {
    /// Stable id (the KV index's worker id): a static backend's position in `backends`.
    pub(crate) id: u64,
    /// Base URL (reported in `x-kvmesh-instance` and metrics).
    pub(crate) url: BackendUrl,
    /// Resolved address to connect to.
    pub(crate) address: SocketAddr,
    /// Wire protocol.
    pub(crate) protocol: Protocol,
    /// LoRA adapters it serves besides the model.
    pub(crate) adapters: Vec<String>,
    /// Its side of disaggregated serving.
    pub(crate) role: Role,
    /// The model's pool it belongs to.
    pub(crate) pool: Option<String>,
    /// Its engine's data-parallel ranks (a static backend: 1).
    pub(crate) dp_ranks: u32,
    /// Its SGLang bootstrap port (`None`: SGLang's default).
    pub(crate) bootstrap_port: Option<u16>,
}

/// One model and its instances.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ModelSpec {
    /// Canonical name.
    pub(crate) name: String,
    /// Other accepted names.
    pub(crate) aliases: Vec<String>,
    /// Load-balancing policy.
    pub(crate) policy: PolicyKind,
    /// Tokenizer directory (`policy: kv`).
    pub(crate) tokenizer: Option<PathBuf>,
    /// Forward string prompts as token ids (`policy: kv`).
    pub(crate) forward_token_ids: bool,
    /// Settings of `policy: kv`.
    pub(crate) kv: KvRoutingConfig,
    /// Migrations per stream.
    pub(crate) migration_limit: u32,
    /// Prefill and decode on separate instances.
    pub(crate) disaggregation: Option<DisaggregationConfig>,
    /// Its pools, in order.
    pub(crate) pools: Vec<PoolConfig>,
    /// Instances.
    pub(crate) instances: Vec<InstanceSpec>,
}

/// A source of models and their instances.
pub(crate) trait Discovery {
    /// The current set of models.
    fn models(&self) -> Result<Vec<ModelSpec>, ProxyError>;
}

/// The models and backends listed in the config file.
#[derive(Debug)]
pub(crate) struct StaticDiscovery<'a> {
    config: &'a Config,
}

impl<'a> StaticDiscovery<'a> {
    /// Reads `config.models`.
    pub(crate) fn new(config: &'a Config) -> Self {
        Self { config }
    }
}

impl Discovery for StaticDiscovery<'_> {
    fn models(&self) -> Result<Vec<ModelSpec>, ProxyError> {
        self.config
            .models
            .iter()
            .map(|model| {
                let instances = model
                    .backends
                    .iter()
                    .enumerate()
                    .map(|(position, backend)| {
                        Ok(InstanceSpec {
                            id: position as u64,
                            address: resolve(&backend.url)?,
                            url: backend.url.clone(),
                            protocol: backend.protocol,
                            adapters: backend.adapters.clone(),
                            role: backend.role,
                            pool: backend.pool.clone(),
                            dp_ranks: 1,
                            bootstrap_port: backend.bootstrap_port,
                        })
                    })
                    .collect::<Result<_, ProxyError>>()?;
                Ok(ModelSpec {
                    name: model.name.clone(),
                    aliases: model.aliases.clone(),
                    policy: model.policy,
                    tokenizer: model.tokenizer.clone(),
                    forward_token_ids: model.forward_token_ids,
                    kv: model.kv.clone(),
                    migration_limit: model.effective_migration_limit(),
                    disaggregation: model.disaggregation.clone(),
                    pools: model.pools.clone(),
                    instances,
                })
            })
            .collect()
    }
}

/// Resolves a backend's host (an IP literal needs no lookup); the first
/// address wins. Runs once at startup.
pub(crate) fn resolve(url: &BackendUrl) -> Result<SocketAddr, ProxyError> {
    let unresolved = || ProxyError::Resolve {
        url: url.to_string(),
        reason: "no address".to_string(),
    };
    (
        url.host().trim_start_matches('[').trim_end_matches(']'),
        url.port(),
    )
        .to_socket_addrs()
        .map_err(|error| ProxyError::Resolve {
            url: url.to_string(),
            reason: error.to_string(),
        })?
        .next()
        .ok_or_else(unresolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_configured_models_with_resolved_addresses() {
        let config = Config::from_yaml_str(
            "models:\n  - name: a\n    aliases: [b]\n    policy: random\n    backends:\n      - url: http://127.0.0.1:9\n        protocol: h2c\n      - url: http://[::1]:10\n",
            "t.yaml",
        )
        .unwrap();
        let models = StaticDiscovery::new(&config).models().unwrap();
        assert_eq!(models.len(), 1);
        assert_eq!(models[0].aliases, ["b"]);
        assert_eq!(models[0].policy, PolicyKind::Random);
        let instances = &models[0].instances;
        assert_eq!(instances[0].address, "127.0.0.1:9".parse().unwrap());
        assert_eq!(instances[0].protocol, Protocol::H2c);
        assert_eq!(instances[1].address, "[::1]:10".parse().unwrap());
        assert_eq!(instances[1].url.as_str(), "http://[::1]:10");
        assert_eq!((instances[0].id, instances[1].id), (0, 1));
    }

    #[test]
    fn localhost_resolves() {
        let url = BackendUrl::parse("http://localhost:8001").unwrap();
        let address = resolve(&url).unwrap();
        assert!(address.ip().is_loopback());
        assert_eq!(address.port(), 8001);
    }
}

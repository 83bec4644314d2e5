//! The protocol's names the endpoint picker reads and writes, from the `epp` section.

use kvmesh_config::EppConfig;

/// The protocol's names, from `epp`.
#[derive(Debug)]
pub(crate) struct Settings {
    /// Endpoints named after the pick.
    pub(crate) fallbacks: usize,
    /// Header (and metadata key) carrying the pick.
    pub(crate) destination_header: String,
    /// Namespace of the pick's metadata and of the served endpoint.
    pub(crate) namespace: String,
    /// Namespace of the subset hint (`<namespace>.subset_hint`).
    pub(crate) subset_namespace: String,
    /// Key of the subset hint (`<destination_header>-subset`).
    pub(crate) subset_key: String,
    /// Key of the served endpoint (`<destination_header>-served`).
    pub(crate) served_key: String,
}

impl Settings {
    /// The names `config` gives.
    pub(crate) fn new(config: &EppConfig) -> Self {
        let header = &config.destination_header;
        let namespace = &config.metadata_namespace;
        Self {
            fallbacks: config.fallbacks,
            destination_header: header.clone(),
            namespace: namespace.clone(),
            subset_namespace: format!("{namespace}.subset_hint"),
            subset_key: format!("{header}-subset"),
            served_key: format!("{header}-served"),
        }
    }
}

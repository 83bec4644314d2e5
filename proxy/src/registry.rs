//! Model name and alias → pool, built once at startup.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::Serialize;

use crate::metrics::{Metrics, NO_MODEL, RouteTable};
use crate::pool::ModelPool;

/// All served models.
#[derive(Debug)]
pub(crate) struct ModelRegistry {
    by_name: HashMap<String, Arc<ModelPool>>,
    pools: Vec<Arc<ModelPool>>,
    /// "a, b, c": every accepted name, for 404 messages.
    known: String,
    /// The `GET /v1/models` response body.
    models_body: Bytes,
    /// Metrics of requests that resolve to no model.
    unattributed: RouteTable,
}

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelEntry<'a>>,
}

#[derive(Serialize)]
struct ModelEntry<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
}

impl ModelRegistry {
    /// Indexes `pools` by name and aliases (`names[i]` are pool `i`'s names,
    /// canonical first; uniqueness is checked by config validation).
    pub(crate) fn new(pools: Vec<(Arc<ModelPool>, Vec<String>)>, metrics: &Metrics) -> Self {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut by_name = HashMap::new();
        let mut names = Vec::new();
        for (pool, aliases) in &pools {
            for name in std::iter::once(pool.name()).chain(aliases.iter().map(String::as_str)) {
                by_name.insert(name.to_string(), Arc::clone(pool));
                names.push(name.to_string());
            }
        }
        let list = ModelList {
            object: "list",
            data: names
                .iter()
                .map(|id| ModelEntry {
                    id,
                    object: "model",
                    created,
                    owned_by: "kvmesh",
                })
                .collect(),
        };
        let models_body = Bytes::from(serde_json::to_vec(&list).unwrap_or_default());
        Self {
            by_name,
            known: names.join(", "),
            models_body,
            pools: pools.into_iter().map(|(pool, _)| pool).collect(),
            unattributed: metrics.routes(NO_MODEL),
        }
    }

    /// The pool serving `name` (canonical or alias).
    pub(crate) fn get(&self, name: &str) -> Option<&Arc<ModelPool>> {
        self.by_name.get(name)
    }

    /// Every pool, in config order.
    pub(crate) fn pools(&self) -> &[Arc<ModelPool>] {
        &self.pools
    }

    /// Every accepted name, comma-separated.
    pub(crate) fn known(&self) -> &str {
        &self.known
    }

    /// The `GET /v1/models` body.
    pub(crate) fn models_body(&self) -> Bytes {
        self.models_body.clone()
    }

    /// Metrics for requests that resolve to no model.
    pub(crate) fn unattributed(&self) -> &RouteTable {
        &self.unattributed
    }
}

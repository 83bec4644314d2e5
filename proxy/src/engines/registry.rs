//! Model name and alias → pool, and LoRA adapter → its base model's pool. Models can appear
//! and disappear at run time (discovery): the lookup tables and the `GET /v1/models` body are
//! rebuilt on each change and swapped in whole, so the request path reads them without a
//! lock. Adapters come and go with the instances that serve them (each pool keeps its own);
//! a name that is no model is looked up among them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use bytes::Bytes;
use serde::Serialize;

use crate::engines::pool::ModelPool;
use crate::metrics::families::{Metrics, NO_MODEL, RouteTable};

/// One served model.
#[derive(Debug, Clone)]
struct Entry {
    pool: Arc<ModelPool>,
    /// Other accepted names.
    aliases: Vec<String>,
    /// When it started being served (seconds since the epoch, for `GET /v1/models`).
    created: u64,
}

/// The served models at one moment.
#[derive(Debug, Default)]
struct View {
    entries: Vec<Entry>,
    by_name: HashMap<String, Arc<ModelPool>>,
    /// "a, b, c": every accepted name, for 404 messages.
    known: String,
    /// The `GET /v1/models` response body.
    models_body: Bytes,
}

impl View {
    fn new(entries: Vec<Entry>) -> Self {
        let mut by_name = HashMap::new();
        let mut names = Vec::new();
        let mut data = Vec::new();
        for entry in &entries {
            let pool = &entry.pool;
            for name in std::iter::once(pool.name()).chain(entry.aliases.iter().map(String::as_str))
            {
                by_name.insert(name.to_string(), Arc::clone(pool));
                names.push(name.to_string());
                data.push((name.to_string(), entry.created));
            }
        }
        let list = ModelList {
            object: "list",
            data: data
                .iter()
                .map(|(id, created)| ModelEntry {
                    id,
                    object: "model",
                    created: *created,
                    owned_by: "kvmesh",
                    parent: None,
                })
                .collect(),
        };
        let models_body = Bytes::from(serde_json::to_vec(&list).unwrap_or_default());
        Self {
            entries,
            by_name,
            known: names.join(", "),
            models_body,
        }
    }
}

/// A pool and the aliases its model is also served under.
pub(crate) type NamedPool = (Arc<ModelPool>, Vec<String>);

/// All served models.
#[derive(Debug)]
pub(crate) struct ModelRegistry {
    view: ArcSwap<View>,
    /// Serialises changes (discovery is the only writer; this keeps it that way).
    writer: Mutex<()>,
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
    /// The base model of a LoRA adapter (as vLLM lists adapters).
    #[serde(skip_serializing_if = "Option::is_none")]
    parent: Option<&'a str>,
}

/// What a request's `model` names: a model's pool, and the LoRA adapter when it named one.
#[derive(Debug, Clone)]
pub(crate) struct Served {
    /// The pool of the model (an adapter's base model).
    pub(crate) pool: Arc<ModelPool>,
    /// The adapter, when the name is one (`None`: the model itself or an alias).
    pub(crate) adapter: Option<Arc<str>>,
}

/// Every adapter served in `view` with its model's entry (the first model serving it), in
/// model order.
fn adapters(view: &View) -> Vec<(String, &Entry)> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for entry in &view.entries {
        for name in entry.pool.adapter_names() {
            if !view.by_name.contains_key(&name) && seen.insert(name.clone()) {
                out.push((name, entry));
            }
        }
    }
    out
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl ModelRegistry {
    /// Indexes `pools` by name and aliases (`names[i]` are pool `i`'s names,
    /// canonical first; uniqueness is checked by config validation).
    pub(crate) fn new(pools: Vec<NamedPool>, metrics: &Metrics) -> Self {
        let created = now_secs();
        let entries = pools
            .into_iter()
            .map(|(pool, aliases)| Entry {
                pool,
                aliases,
                created,
            })
            .collect();
        Self {
            view: ArcSwap::from_pointee(View::new(entries)),
            writer: Mutex::new(()),
            unattributed: metrics.routes(NO_MODEL),
        }
    }

    /// The pool serving `name` (canonical or alias).
    pub(crate) fn get(&self, name: &str) -> Option<Arc<ModelPool>> {
        self.view.load().by_name.get(name).cloned()
    }

    /// What `name` names: a model (canonical or alias), else a LoRA adapter some instance
    /// serves (the first model in order whose instances serve it).
    pub(crate) fn resolve(&self, name: &str) -> Option<Served> {
        let view = self.view.load();
        if let Some(pool) = view.by_name.get(name) {
            return Some(Served {
                pool: Arc::clone(pool),
                adapter: None,
            });
        }
        view.entries
            .iter()
            .find(|entry| entry.pool.serves_adapter(name))
            .map(|entry| Served {
                pool: Arc::clone(&entry.pool),
                adapter: Some(Arc::from(name)),
            })
    }

    /// Every pool, in config order, then in order of appearance.
    pub(crate) fn pools(&self) -> Vec<Arc<ModelPool>> {
        self.view
            .load()
            .entries
            .iter()
            .map(|entry| Arc::clone(&entry.pool))
            .collect()
    }

    /// Every accepted name, comma-separated (models, aliases, then adapters).
    pub(crate) fn known(&self) -> String {
        let view = self.view.load();
        let adapters = adapters(&view);
        if adapters.is_empty() {
            return view.known.clone();
        }
        let names = adapters.iter().map(|(name, _)| name.as_str());
        std::iter::once(view.known.as_str())
            .chain(names)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The `GET /v1/models` body: models and aliases, then each adapter with its base model as
    /// `parent`.
    pub(crate) fn models_body(&self) -> Bytes {
        let view = self.view.load();
        let adapters = adapters(&view);
        if adapters.is_empty() {
            return view.models_body.clone();
        }
        let mut data: Vec<ModelEntry<'_>> = Vec::new();
        for entry in &view.entries {
            let names =
                std::iter::once(entry.pool.name()).chain(entry.aliases.iter().map(String::as_str));
            data.extend(names.map(|id| ModelEntry {
                id,
                object: "model",
                created: entry.created,
                owned_by: "kvmesh",
                parent: None,
            }));
        }
        data.extend(adapters.iter().map(|(name, entry)| ModelEntry {
            id: name,
            object: "model",
            created: entry.created,
            owned_by: "kvmesh",
            parent: Some(entry.pool.name()),
        }));
        let list = ModelList {
            object: "list",
            data,
        };
        Bytes::from(serde_json::to_vec(&list).unwrap_or_default())
    }

    /// Metrics for requests that resolve to no model.
    pub(crate) fn unattributed(&self) -> &RouteTable {
        &self.unattributed
    }

    /// Starts serving `pool` under its name (no aliases). Returns false, changing nothing,
    /// when the name is taken.
    pub(crate) fn insert(&self, pool: Arc<ModelPool>) -> bool {
        let _writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.view.load();
        if current.by_name.contains_key(pool.name()) {
            return false;
        }
        let mut entries = current.entries.clone();
        entries.push(Entry {
            pool,
            aliases: Vec::new(),
            created: now_secs(),
        });
        self.view.store(Arc::new(View::new(entries)));
        true
    }

    /// Stops serving the model named `name` (canonical) and retires its pool; requests that
    /// already hold the pool finish. Returns the pool when it was served.
    pub(crate) fn remove(&self, name: &str) -> Option<Arc<ModelPool>> {
        let _writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let current = self.view.load();
        let at = current.entries.iter().position(|e| e.pool.name() == name)?;
        let mut entries = current.entries.clone();
        let removed = entries.remove(at).pool;
        self.view.store(Arc::new(View::new(entries)));
        removed.retire();
        Some(removed)
    }
}

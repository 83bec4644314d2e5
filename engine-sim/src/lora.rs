//! LoRA adapters, as vLLM's OpenAI server handles them: the `--lora-modules` items
//! ([`LoraModule`]), the identity an adapter's requests and KV blocks carry ([`Lora`]) and each
//! engine's registry of loaded adapters, which `GET /v1/models`, `POST /v1/load_lora_adapter`
//! and `POST /v1/unload_lora_adapter` read and change.
//!
//! The simulator has no weights: an adapter's path is only reported, never read. What an
//! adapter changes is the identity of its KV blocks (see [`crate::hashing`]) and the `model`
//! its responses name.

use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};

use serde::Deserialize;

use crate::hashing::lora_seed;

/// One `--lora-modules` item (vLLM's `LoRAModulePath`): `NAME=PATH`, or the JSON object
/// `{"name": ..., "path": ..., "base_model_name": ...}`.
///
/// `base_model_name` is accepted and ignored: vLLM uses it as the adapter's `parent` only when
/// it names a served base model, and the simulator serves one, which is the parent anyway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    /// The name requests use as `model`.
    pub name: String,
    /// Where the adapter lives (reported as `root` in `/v1/models`, never read).
    pub path: String,
}

/// The JSON form of a `--lora-modules` item; unknown keys are rejected, as vLLM does.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonModule {
    name: String,
    path: String,
    #[serde(default, rename = "base_model_name")]
    _base_model_name: Option<String>,
}

impl FromStr for LoraModule {
    type Err = String;

    /// vLLM's rule: an item with `=` and without `,` is `NAME=PATH`; anything else is JSON.
    fn from_str(item: &str) -> Result<Self, String> {
        if item.contains('=') && !item.contains(',') {
            let mut parts = item.split('=');
            return match (parts.next(), parts.next(), parts.next()) {
                (Some(name), Some(path), None) => Ok(Self {
                    name: name.to_owned(),
                    path: path.to_owned(),
                }),
                _ => Err(format!(
                    "Invalid --lora-modules item {item:?}: expected NAME=PATH with one `=`"
                )),
            };
        }
        let module: JsonModule = serde_json::from_str(item).map_err(|e| {
            if e.is_syntax() || e.is_eof() {
                format!("Invalid JSON format for --lora-modules: {item}")
            } else {
                format!("Invalid fields for --lora-modules: {item} - {e}")
            }
        })?;
        Ok(Self {
            name: module.name,
            path: module.path,
        })
    }
}

/// A loaded adapter as its requests and their KV blocks carry it (vLLM's `LoRARequest`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lora {
    /// vLLM's `lora_int_id`: 1 for the first adapter an engine loads, +1 for every later load;
    /// never reused, not even after an unload.
    pub id: u64,
    /// The adapter's name (vLLM's `lora_name`).
    pub name: Arc<str>,
}

impl Lora {
    /// The seed of this adapter's local block hashes ([`lora_seed`]).
    pub(crate) fn hash_seed(&self) -> u64 {
        lora_seed(Some(&self.name))
    }
}

/// Why a load or an unload was refused. The messages are vLLM's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum LoraError {
    /// Neither `--enable-lora` nor `--lora-modules` was given.
    #[error("LoRA is not enabled. Start the engine with --enable-lora.")]
    NotEnabled,
    /// A load without a name or a path.
    #[error("Both 'lora_name' and 'lora_path' must be provided.")]
    MissingNameOrPath,
    /// A load of a name already loaded, without `load_inplace`.
    #[error(
        "The lora adapter '{0}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
    )]
    AlreadyLoaded(String),
    /// An unload without a name.
    #[error("'lora_name' needs to be provided to unload a LoRA adapter.")]
    MissingName,
    /// An unload of a name not loaded.
    #[error("The lora adapter '{0}' cannot be found.")]
    NotFound(String),
}

/// An adapter in the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LoadedLora {
    /// What its requests carry.
    pub lora: Lora,
    /// Its path, as given.
    pub path: String,
}

#[derive(Debug, Default)]
struct Loaded {
    /// In load order (the order `/v1/models` lists them).
    adapters: Vec<LoadedLora>,
    /// The last id handed out.
    last_id: u64,
}

/// One engine's loaded adapters.
#[derive(Debug)]
pub(crate) struct LoraRegistry {
    enabled: bool,
    loaded: Mutex<Loaded>,
}

impl LoraRegistry {
    /// A registry holding `modules` (ids 1, 2, ... in order). LoRA is on when `enable_lora` is
    /// set or `modules` is not empty. Fails as vLLM fails to start: on an empty name or path, or
    /// a name given twice.
    pub(crate) fn new(enable_lora: bool, modules: &[LoraModule]) -> Result<Self, LoraError> {
        let registry = Self {
            enabled: enable_lora || !modules.is_empty(),
            loaded: Mutex::default(),
        };
        for module in modules {
            registry.load(&module.name, &module.path, false)?;
        }
        Ok(registry)
    }

    fn loaded(&self) -> std::sync::MutexGuard<'_, Loaded> {
        self.loaded.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The loaded adapter called `name`, if any.
    pub(crate) fn resolve(&self, name: &str) -> Option<Lora> {
        if !self.enabled {
            return None;
        }
        self.loaded()
            .adapters
            .iter()
            .find(|a| &*a.lora.name == name)
            .map(|a| a.lora.clone())
    }

    /// Every loaded adapter, in load order.
    pub(crate) fn list(&self) -> Vec<LoadedLora> {
        self.loaded().adapters.clone()
    }

    /// Loads adapter `name` from `path` (nothing is read). With `in_place` a loaded `name` is
    /// reloaded from `path` and keeps its id, as vLLM's `load_inplace` does.
    pub(crate) fn load(&self, name: &str, path: &str, in_place: bool) -> Result<(), LoraError> {
        if !self.enabled {
            return Err(LoraError::NotEnabled);
        }
        if name.is_empty() || path.is_empty() {
            return Err(LoraError::MissingNameOrPath);
        }
        let mut loaded = self.loaded();
        if let Some(existing) = loaded.adapters.iter_mut().find(|a| &*a.lora.name == name) {
            if !in_place {
                return Err(LoraError::AlreadyLoaded(name.to_owned()));
            }
            path.clone_into(&mut existing.path);
            return Ok(());
        }
        loaded.last_id += 1;
        let lora = Lora {
            id: loaded.last_id,
            name: name.into(),
        };
        loaded.adapters.push(LoadedLora {
            lora,
            path: path.to_owned(),
        });
        Ok(())
    }

    /// Unloads adapter `name`. Requests already running with it finish with it; its cached
    /// blocks stay until evicted (a later load of the same name finds them again, as in vLLM,
    /// whose block hashes carry the name, not the id).
    pub(crate) fn unload(&self, name: &str) -> Result<(), LoraError> {
        if name.is_empty() {
            return Err(LoraError::MissingName);
        }
        let mut loaded = self.loaded();
        let before = loaded.adapters.len();
        loaded.adapters.retain(|a| &*a.lora.name != name);
        if loaded.adapters.len() == before {
            return Err(LoraError::NotFound(name.to_owned()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(name: &str, path: &str) -> LoraModule {
        LoraModule {
            name: name.to_owned(),
            path: path.to_owned(),
        }
    }

    #[test]
    fn modules_parse_in_both_of_vllms_forms() {
        assert_eq!(
            "sql=/adapters/sql".parse(),
            Ok(module("sql", "/adapters/sql"))
        );
        let json = r#"{"name": "sql", "path": "/adapters/sql", "base_model_name": "m"}"#;
        assert_eq!(json.parse(), Ok(module("sql", "/adapters/sql")));
        let json = r#"{"name": "sql", "path": "/a=b"}"#;
        assert_eq!(json.parse(), Ok(module("sql", "/a=b")));
        // `=` without `,` is the NAME=PATH form even when it looks like JSON.
        assert_eq!(
            r#"{"name":"a=b"}"#.parse(),
            Ok(module(r#"{"name":"a"#, r#"b"}"#))
        );
        assert!("a=b=c".parse::<LoraModule>().is_err());
        let no_path = r#"{"name": "sql"}"#.parse::<LoraModule>();
        assert!(
            no_path
                .as_ref()
                .is_err_and(|e| e.starts_with("Invalid fields for --lora-modules")),
            "{no_path:?}"
        );
        let unknown = r#"{"name": "a", "path": "p", "rank": 8}"#.parse::<LoraModule>();
        assert!(unknown.is_err(), "{unknown:?}");
        assert_eq!(
            "sql".parse::<LoraModule>(),
            Err("Invalid JSON format for --lora-modules: sql".to_owned())
        );
    }

    #[test]
    fn static_modules_get_ids_from_one_and_bad_ones_fail_the_start() {
        let r = LoraRegistry::new(false, &[module("a", "/a"), module("b", "/b")]).expect("ok");
        let ids: Vec<(u64, String)> = r
            .list()
            .iter()
            .map(|l| (l.lora.id, l.path.clone()))
            .collect();
        assert_eq!(ids, vec![(1, "/a".to_owned()), (2, "/b".to_owned())]);
        assert_eq!(
            LoraRegistry::new(false, &[module("a", "/a"), module("a", "/b")]).err(),
            Some(LoraError::AlreadyLoaded("a".to_owned()))
        );
        assert_eq!(
            LoraRegistry::new(false, &[module("", "/a")]).err(),
            Some(LoraError::MissingNameOrPath)
        );
    }

    #[test]
    fn runtime_loads_and_unloads() {
        let r = LoraRegistry::new(true, &[]).expect("ok");
        assert_eq!(r.resolve("a"), None);
        r.load("a", "/a", false).expect("load");
        let a = r.resolve("a").expect("loaded");
        assert_eq!((a.id, &*a.name), (1, "a"));
        assert_eq!(
            r.load("a", "/other", false),
            Err(LoraError::AlreadyLoaded("a".to_owned()))
        );
        r.load("a", "/a2", true).expect("in place");
        assert_eq!(r.list()[0].path, "/a2");
        assert_eq!(
            r.resolve("a").map(|l| l.id),
            Some(1),
            "in place keeps the id"
        );
        assert_eq!(r.load("b", "", false), Err(LoraError::MissingNameOrPath));
        assert_eq!(r.unload("b"), Err(LoraError::NotFound("b".to_owned())));
        assert_eq!(r.unload(""), Err(LoraError::MissingName));
        r.unload("a").expect("unload");
        assert_eq!(r.resolve("a"), None);
        r.load("a", "/a", false).expect("reload");
        assert_eq!(
            r.resolve("a").map(|l| l.id),
            Some(2),
            "ids are never reused"
        );
    }

    #[test]
    fn without_enable_lora_nothing_loads() {
        let r = LoraRegistry::new(false, &[]).expect("ok");
        assert_eq!(r.load("a", "/a", false), Err(LoraError::NotEnabled));
        assert!(r.list().is_empty());
    }

    #[test]
    fn adapter_hash_seed_follows_the_name() {
        let lora = Lora {
            id: 7,
            name: "my-adapter".into(),
        };
        assert_eq!(lora.hash_seed(), 2_360_313_164_392_603_308);
    }
}

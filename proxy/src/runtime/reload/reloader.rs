//! Applying a new config: parse, validate, check what cannot change, build the
//! new state, swap it in, retire the old one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use kvmesh_config::{Config, ConfigError};
use tokio::sync::Mutex;
use tokio::task::JoinSet;

use crate::edge::error::ProxyError;
use crate::edge::tls::{TlsSettings, TlsTerminator};
use crate::metrics::families::Metrics;
use crate::runtime::control_plane::{ReloadNotifier, Reloaded};
use crate::runtime::reload::compatible::incompatibility;
use crate::runtime::server::{build_state, has_control_plane, same_models, spawn_state_tasks};
use crate::state::shared::State;

/// Why a reload was rejected (the previous config keeps serving).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The proxy was started from a config built in code: there is no file to re-read.
    #[error(
        "there is no config file to reload (the proxy was started from a config built in code)"
    )]
    NoFile,
    /// The new config does not parse or validate.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The new config changes what only a restart can (listeners, the admin address).
    #[error("{0}")]
    Incompatible(String),
    /// The new state could not be built (TLS files, tokenizers, backends).
    #[error(transparent)]
    Build(#[from] ProxyError),
    /// Building the new state panicked.
    #[error("building the new state failed: {0}")]
    Interrupted(String),
}

/// What started a reload (for the log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trigger {
    /// SIGHUP, or a call of [`ReloadHandle::reload`].
    Signal,
    /// The config file changed.
    FileChange,
    /// `POST /reload` at the admin listener.
    Admin,
    /// [`ReloadHandle::apply`] with a config built in code.
    Api,
}

impl Trigger {
    fn label(self) -> &'static str {
        match self {
            Self::Signal => "signal",
            Self::FileChange => "file_change",
            Self::Admin => "admin",
            Self::Api => "api",
        }
    }
}

/// The config in force and the background tasks of its state.
#[derive(Debug)]
struct Applied {
    config: Config,
    /// The file text it came from (a file change to the same text is no reload).
    text: Option<String>,
    tasks: JoinSet<()>,
}

/// Swaps configs. Reloads are serialized; none runs on the request path.
#[derive(Debug)]
pub(crate) struct Reloader {
    path: Option<PathBuf>,
    state: Arc<ArcSwap<State>>,
    metrics: Metrics,
    /// The data listeners' TLS, in config order.
    tls: Vec<Option<Arc<TlsTerminator>>>,
    /// With a control plane: where the discovery loop hears of each new state.
    reloads: Option<ReloadNotifier>,
    applied: Mutex<Applied>,
}

impl Reloader {
    /// A reloader for the proxy serving `state`, built from `config` (read from
    /// `path` when there is one).
    pub(crate) fn new(
        path: Option<PathBuf>,
        state: Arc<ArcSwap<State>>,
        metrics: Metrics,
        tls: Vec<Option<Arc<TlsTerminator>>>,
        reloads: Option<ReloadNotifier>,
        config: Config,
    ) -> Self {
        let text = path
            .as_deref()
            .and_then(|path| std::fs::read_to_string(path).ok());
        Self {
            path,
            state,
            metrics,
            tls,
            reloads,
            applied: Mutex::new(Applied {
                config,
                text,
                tasks: JoinSet::new(),
            }),
        }
    }

    /// Starts the current state's background tasks (when the proxy starts serving).
    pub(crate) async fn start_tasks(&self) {
        let mut applied = self.applied.lock().await;
        applied.tasks = spawn_state_tasks(&self.state.load_full(), &applied.config);
    }

    /// The config file, if the proxy was started from one.
    pub(crate) fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Re-reads the config file and applies it. A file change whose text is the
    /// one in force is no reload (`Ok(false)`).
    pub(crate) async fn reload(&self, trigger: Trigger) -> Result<bool, ReloadError> {
        let Some(path) = &self.path else {
            return Err(ReloadError::NoFile);
        };
        let mut applied = self.applied.lock().await;
        // The file is read off the runtime threads: a slow disk must not stall requests.
        let reading = path.clone();
        let text = tokio::task::spawn_blocking(move || std::fs::read_to_string(reading))
            .await
            .unwrap_or_else(|join| Err(std::io::Error::other(join.to_string())))
            .map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            });
        let result = match text {
            Ok(text) if trigger == Trigger::FileChange && applied.text.as_ref() == Some(&text) => {
                return Ok(false);
            }
            Ok(text) => {
                let parsed = Config::from_yaml_str(&text, &path.display().to_string());
                match parsed {
                    Ok(config) => self.swap(&mut applied, config, Some(text)).await,
                    Err(error) => Err(error.into()),
                }
            }
            Err(error) => Err(error.into()),
        };
        self.record(trigger, result).map(|()| true)
    }

    /// Validates and applies `config`.
    pub(crate) async fn apply(&self, config: Config, trigger: Trigger) -> Result<(), ReloadError> {
        let mut applied = self.applied.lock().await;
        let result = match config.validate() {
            Ok(()) => self.swap(&mut applied, config, None).await,
            Err(error) => Err(error.into()),
        };
        self.record(trigger, result)
    }

    /// Stops the current state's background tasks (at shutdown).
    pub(crate) async fn stop(&self) {
        self.applied.lock().await.tasks.abort_all();
    }

    /// Logs and counts the outcome of a reload.
    fn record(&self, trigger: Trigger, result: Result<(), ReloadError>) -> Result<(), ReloadError> {
        self.metrics.edge.count_reload(result.is_ok());
        match &result {
            Ok(()) => tracing::info!(trigger = trigger.label(), "config reloaded"),
            Err(error) => tracing::warn!(
                trigger = trigger.label(),
                reason = %error,
                "config reload rejected; the previous config keeps serving"
            ),
        }
        result
    }

    /// Builds the state of `config` and swaps it in.
    async fn swap(
        &self,
        applied: &mut Applied,
        config: Config,
        text: Option<String>,
    ) -> Result<(), ReloadError> {
        if let Some(reason) = incompatibility(&applied.config, &config) {
            return Err(ReloadError::Incompatible(reason));
        }
        // With discovery or KV events, instances live in the pools and the control-plane
        // connections stay: models may change (changed ones get new pools that take over
        // the instances), what the connections and instances are built from may not.
        let dynamic = has_control_plane(&applied.config) || has_control_plane(&config);
        if dynamic
            && (applied.config.discovery != config.discovery
                || applied.config.events != config.events
                || applied.config.limits.connect_timeout != config.limits.connect_timeout
                || applied.config.health_check != config.health_check)
        {
            return Err(ReloadError::Incompatible(
                "with discovery or events enabled, discovery, events, health_check and \
                 limits.connect_timeout change only on restart (models may change)"
                    .to_string(),
            ));
        }
        let tls = config
            .listeners
            .iter()
            .enumerate()
            .map(|(i, listener)| {
                listener
                    .tls
                    .as_ref()
                    .map(|tls| TlsSettings::load(tls, &format!("listeners[{i}].tls")))
                    .transpose()
                    .map_err(ProxyError::Tls)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let previous = self.state.load_full();
        let metrics = self.metrics.clone();
        let building = config.clone();
        let in_force = applied.config.clone();
        // Loading tokenizers and resolving backends may block.
        let (state, _) = tokio::task::spawn_blocking(move || {
            build_state(&building, &metrics, Some((&previous, &in_force)))
        })
        .await
        .map_err(|error| ReloadError::Interrupted(error.to_string()))??;
        let state = Arc::new(state);
        for (terminator, settings) in self.tls.iter().zip(tls) {
            if let (Some(terminator), Some(settings)) = (terminator, settings) {
                terminator.install(settings);
            }
        }
        self.state.store(Arc::clone(&state));
        if !dynamic {
            // The retired state's probes and sweepers stop; the new state's start.
            let tasks = spawn_state_tasks(&state, &config);
            std::mem::replace(&mut applied.tasks, tasks).abort_all();
        } else if let Some(reloads) = &self.reloads
            && !same_models(&applied.config, &config)
        {
            // The discovery loop moves the instances' events to their new pools and starts
            // the new pools' background tasks.
            reloads.send_replace(Some(Reloaded {
                state: Arc::clone(&state),
                configured: config.models.iter().map(|m| m.name.clone()).collect(),
            }));
        }
        applied.config = config;
        applied.text = text;
        Ok(())
    }
}

/// Reloads the config of a running proxy (see [`Proxy::reload_handle`](crate::Proxy::reload_handle)).
#[derive(Debug, Clone)]
pub struct ReloadHandle {
    reloader: Arc<Reloader>,
}

impl ReloadHandle {
    /// A handle on `reloader`.
    pub(crate) fn new(reloader: Arc<Reloader>) -> Self {
        Self { reloader }
    }

    /// Re-reads the config file and applies it (what SIGHUP does). On error the
    /// previous config keeps serving.
    pub async fn reload(&self) -> Result<(), ReloadError> {
        self.reloader.reload(Trigger::Signal).await.map(|_| ())
    }

    /// Validates `config` and applies it. On error the previous config keeps serving.
    pub async fn apply(&self, config: Config) -> Result<(), ReloadError> {
        self.reloader.apply(config, Trigger::Api).await
    }
}

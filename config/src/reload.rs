//! Watching files for changes: the config file (hot reload) and the data
//! listeners' certificates and keys.

use std::time::Duration;

use serde::Deserialize;

use crate::FieldPath;
use crate::violation::{Checked, positive};

/// What the proxy watches at run time. A reload also happens on SIGHUP and on
/// `POST /reload` at the admin listener, whatever these say.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReloadConfig {
    /// Reload the config when its file changes, and a listener's certificate when
    /// its `cert`, `key` or `client_ca` file changes.
    pub watch: bool,
    /// How often watched files are checked (modification time and size).
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub poll_interval: Duration,
}

impl Default for ReloadConfig {
    fn default() -> Self {
        Self {
            watch: true,
            poll_interval: Duration::from_secs(2),
        }
    }
}

/// Checks `reload`; `path` points at it.
pub(crate) fn check_reload(reload: &ReloadConfig, path: &FieldPath) -> Checked {
    positive(reload.poll_interval, path.key("poll_interval"))
}

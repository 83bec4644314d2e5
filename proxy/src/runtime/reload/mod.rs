//! Config hot reload: on SIGHUP, a change of the config file or
//! `POST /reload`, the new config is parsed, validated and built into a new
//! [`State`](crate::state::shared::State) with the same function startup uses, then
//! swapped in atomically. Each request loads the state once when its head
//! arrives, so requests in flight finish on the config they started with. A
//! state's background tasks (health probes, KV sweepers) live in a task set
//! the reloader owns; retiring the state aborts them. A config that cannot be
//! applied is rejected with its reason logged, and the old one keeps serving.

mod compatible;
mod reloader;
mod watch;

pub use reloader::{ReloadError, ReloadHandle};
pub(crate) use reloader::{Reloader, Trigger};
pub(crate) use watch::watch_files;

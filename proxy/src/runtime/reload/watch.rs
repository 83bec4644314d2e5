//! Polling watched files: the config file (a change reloads it) and the TLS
//! listeners' certificate, key and client-CA files (a change re-reads them).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{MissedTickBehavior, interval};

use crate::edge::tls::terminator::Refresh;
use crate::edge::tls::{FileStamps, ListenerTls};
use crate::runtime::reload::{Reloader, Trigger};

/// Polls every `period` until the task is dropped.
pub(crate) async fn watch_files(
    reloader: Arc<Reloader>,
    tls: Vec<Arc<ListenerTls>>,
    period: Duration,
) {
    let mut config_stamps = reloader.path().map(|path| FileStamps::of([path]));
    let mut ticks = interval(period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        if let Some(stamps) = config_stamps.as_mut() {
            let now = stamps.now();
            if now != *stamps {
                *stamps = now;
                // The outcome is logged and counted by the reloader.
                let _ = reloader.reload(Trigger::FileChange).await;
            }
        }
        for watched in &tls {
            match watched.terminator.refresh() {
                Refresh::Unchanged => {}
                Refresh::Reloaded => {
                    watched.metrics.reload_ok.inc();
                    tracing::info!(listener = %watched.listener, "TLS certificate reloaded");
                }
                Refresh::Rejected(error) => {
                    watched.metrics.reload_rejected.inc();
                    tracing::warn!(
                        listener = %watched.listener,
                        %error,
                        "changed TLS files cannot be used; the previous certificate stays in use"
                    );
                }
            }
        }
    }
}

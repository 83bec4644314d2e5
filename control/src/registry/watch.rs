//! The one place where a registry watch survives reconnects: list, watch from the listed
//! revision + 1, and on any break re-list with backoff and emit only the differences.

use std::collections::HashMap;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::mpsc;

use super::{Listing, Watch, WatchEvent};
use crate::backoff::Backoff;
use crate::error::ControlError;
use crate::instance::InstanceRecord;

/// A raw change under a watched prefix.
#[derive(Debug, Clone)]
pub(crate) enum RawChange {
    /// `key` now holds `value`.
    Put(String, Bytes),
    /// `key` was deleted.
    Delete(String),
}

/// An open stream of raw changes.
#[async_trait]
pub(crate) trait RawStream: Send {
    /// The next changes; `Ok(None)` or an error when the stream broke.
    async fn next(&mut self) -> Result<Option<Vec<RawChange>>, ControlError>;
}

/// What a backend provides for [`spawn_watch`].
#[async_trait]
pub(crate) trait WatchSource: Send + Sync + 'static {
    /// The raw (key, value) pairs under `prefix` and the revision they are valid at.
    async fn list_raw(&self, prefix: &str) -> Result<(Vec<(String, Bytes)>, i64), ControlError>;

    /// Changes under `prefix` from `revision` on.
    async fn watch_raw(
        &self,
        prefix: &str,
        revision: i64,
    ) -> Result<Box<dyn RawStream>, ControlError>;
}

/// The records last emitted to the consumer.
struct Emitter {
    known: HashMap<String, InstanceRecord>,
    tx: mpsc::Sender<WatchEvent>,
}

impl Emitter {
    /// Sends an event; `false` when the consumer is gone.
    async fn send(&self, event: WatchEvent) -> bool {
        self.tx.send(event).await.is_ok()
    }

    async fn put(&mut self, key: String, value: &[u8]) -> bool {
        match InstanceRecord::from_json(value) {
            Ok(record) => {
                if self.known.get(&key) == Some(&record) {
                    return true;
                }
                self.known.insert(key.clone(), record.clone());
                self.send(WatchEvent::Put { key, record }).await
            }
            Err(e) => {
                tracing::warn!(%key, error = %e, "ignoring an invalid instance record");
                self.delete(key).await
            }
        }
    }

    async fn delete(&mut self, key: String) -> bool {
        if self.known.remove(&key).is_none() {
            return true;
        }
        self.send(WatchEvent::Delete { key }).await
    }

    /// Emits the difference between what was emitted and `listing`, then `Synced`.
    async fn resync(&mut self, listing: Vec<(String, Bytes)>) -> bool {
        let mut listed: HashMap<String, Bytes> = listing.into_iter().collect();
        let gone: Vec<String> = self
            .known
            .keys()
            .filter(|k| !listed.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            if !self.delete(key).await {
                return false;
            }
        }
        let mut keys: Vec<String> = listed.keys().cloned().collect();
        keys.sort();
        for key in keys {
            if let Some(value) = listed.remove(&key)
                && !self.put(key, &value).await
            {
                return false;
            }
        }
        self.send(WatchEvent::Synced).await
    }

    async fn apply(&mut self, changes: Vec<RawChange>) -> bool {
        for change in changes {
            let alive = match change {
                RawChange::Put(key, value) => self.put(key, &value).await,
                RawChange::Delete(key) => self.delete(key).await,
            };
            if !alive {
                return false;
            }
        }
        true
    }
}

/// The valid records under `prefix` in `source` now, as [`super::Registry::list`] returns them.
pub(crate) async fn list_records<S: WatchSource>(
    source: &S,
    prefix: &str,
) -> Result<Listing, ControlError> {
    let (raw, revision) = source.list_raw(prefix).await?;
    let records = raw
        .into_iter()
        .filter_map(|(key, value)| Some((key, InstanceRecord::from_json(&value).ok()?)))
        .collect();
    Ok(Listing { records, revision })
}

/// Runs the reconnecting watch loop of `source` over `prefix` in a task.
pub(crate) fn spawn_watch<S: WatchSource>(source: S, prefix: String) -> Watch {
    let (tx, rx) = mpsc::channel(1024);
    let task = tokio::spawn(async move {
        let mut emitter = Emitter {
            known: HashMap::new(),
            tx,
        };
        let mut backoff = Backoff::default();
        let mut connected = true;
        loop {
            match source.list_raw(&prefix).await {
                Ok((listing, revision)) => {
                    if !emitter.resync(listing).await {
                        return;
                    }
                    connected = true;
                    match source.watch_raw(&prefix, revision + 1).await {
                        Ok(mut stream) => loop {
                            match stream.next().await {
                                Ok(Some(changes)) => {
                                    backoff.reset();
                                    if !emitter.apply(changes).await {
                                        return;
                                    }
                                }
                                Ok(None) => break,
                                Err(e) => {
                                    tracing::info!(%prefix, error = %e, "registry watch broke");
                                    break;
                                }
                            }
                        },
                        Err(e) => tracing::info!(%prefix, error = %e, "cannot open registry watch"),
                    }
                }
                // Refused credentials need an operator: say so each time.
                Err(e @ ControlError::Refused { .. }) => {
                    tracing::warn!(%prefix, error = %e, "the registry refused this client");
                }
                Err(e) => tracing::debug!(%prefix, error = %e, "cannot list registry"),
            }
            if connected {
                connected = false;
                if !emitter.send(WatchEvent::Disconnected).await {
                    return;
                }
            }
            if emitter.tx.is_closed() {
                return;
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    });
    Watch::new(rx, task)
}

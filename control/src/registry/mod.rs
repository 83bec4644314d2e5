//! Instance discovery: the [`Registry`] trait (leases, records, a reconnecting watch) and its
//! etcd and in-process implementations.

#[cfg(feature = "transports")]
mod etcd;
#[cfg(feature = "transports")]
mod etcd_members;
mod in_process;
mod watch;

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::Stream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

#[cfg(feature = "transports")]
pub use etcd::{EtcdRegistry, EtcdSettings};
pub use in_process::InProcessRegistry;

use crate::error::ControlError;
use crate::instance::InstanceRecord;

/// A lease: records written under it disappear when it expires or is revoked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub i64);

/// The records under a prefix at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Listing {
    /// (key, record) pairs, sorted by key. Values that are not valid records are left out.
    pub records: Vec<(String, InstanceRecord)>,
    /// The store's revision the listing is valid at.
    pub revision: i64,
}

/// A change seen by a [`Watch`].
#[derive(Debug, Clone, PartialEq)]
pub enum WatchEvent {
    /// A record appeared or changed.
    Put {
        /// Its key.
        key: String,
        /// The new record.
        record: InstanceRecord,
    },
    /// A record disappeared (deleted, lease expired, or gone while the watch was down).
    Delete {
        /// Its key.
        key: String,
    },
    /// The watch has emitted everything the store holds: after the initial listing, and after
    /// each re-listing on reconnect (which emits only the differences).
    Synced,
    /// The connection to the store was lost; the watch keeps the last known records and
    /// reconnects with backoff. Consumers should keep using what they have.
    Disconnected,
}

/// A stream of [`WatchEvent`]s under a prefix, kept alive across reconnects by a background
/// task (stopped when the `Watch` is dropped).
#[derive(Debug)]
pub struct Watch {
    rx: mpsc::Receiver<WatchEvent>,
    task: JoinHandle<()>,
}

impl Watch {
    pub(crate) fn new(rx: mpsc::Receiver<WatchEvent>, task: JoinHandle<()>) -> Self {
        Self { rx, task }
    }

    /// The next change; `None` only if the registry is gone.
    pub async fn next(&mut self) -> Option<WatchEvent> {
        self.rx.recv().await
    }
}

impl Stream for Watch {
    type Item = WatchEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<WatchEvent>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Where instances register and how the proxy finds them. Object-safe: use
/// `Arc<dyn Registry>`. Keys come from [`crate::Namespace::instance_key`].
#[async_trait]
pub trait Registry: Send + Sync + 'static {
    /// Creates a lease that expires `ttl` after the last keep-alive (whole seconds, at least 1).
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, ControlError>;

    /// Refreshes a lease; returns its TTL. [`ControlError::LeaseNotFound`] means the lease is
    /// gone (expired, revoked, or the store lost it): grant a new one and put the record again.
    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, ControlError>;

    /// Ends a lease now, deleting every key written under it.
    async fn revoke(&self, lease: LeaseId) -> Result<(), ControlError>;

    /// Writes a record, under `lease` when given (then it lives only as long as the lease).
    async fn put(
        &self,
        key: &str,
        record: &InstanceRecord,
        lease: Option<LeaseId>,
    ) -> Result<(), ControlError>;

    /// Deletes a key (no error when it does not exist).
    async fn delete(&self, key: &str) -> Result<(), ControlError>;

    /// The records under `prefix` now.
    async fn list(&self, prefix: &str) -> Result<Listing, ControlError>;

    /// Watches `prefix`: first a `Put` per existing record and `Synced`, then changes. On a
    /// broken connection it emits `Disconnected`, reconnects with backoff (100 ms doubling to
    /// 5 s), re-lists, emits only the differences from what it last emitted, then `Synced`.
    fn watch(&self, prefix: &str) -> Watch;
}

//! [`Registry`] inside one process (the demo's embedded default): a map with leases, revisions
//! and a short change history, watched through the same reconnecting loop as etcd.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::broadcast;

use super::watch::{RawChange, RawStream, WatchSource, list_records, spawn_watch};
use super::{LeaseId, Listing, Registry, Watch};
use crate::error::ControlError;
use crate::instance::InstanceRecord;

/// Changes kept for watches that start from an older revision.
const HISTORY: usize = 1024;
/// How often expired leases are swept.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

#[derive(Debug)]
struct Lease {
    ttl: Duration,
    deadline: Instant,
}

#[derive(Debug, Default)]
struct State {
    entries: BTreeMap<String, (Bytes, Option<i64>)>,
    leases: HashMap<i64, Lease>,
    revision: i64,
    next_lease: i64,
    history: VecDeque<(i64, RawChange)>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    changes: broadcast::Sender<(i64, RawChange)>,
    sweeping: AtomicBool,
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a change at the next revision and tells the watches.
    fn record(&self, state: &mut State, change: RawChange) {
        state.revision += 1;
        if state.history.len() == HISTORY {
            state.history.pop_front();
        }
        state.history.push_back((state.revision, change.clone()));
        // No watcher is not an error.
        let _ = self.changes.send((state.revision, change));
    }

    fn delete_locked(&self, state: &mut State, key: &str) {
        if state.entries.remove(key).is_some() {
            self.record(state, RawChange::Delete(key.to_owned()));
        }
    }

    fn drop_lease(&self, state: &mut State, lease: i64) {
        state.leases.remove(&lease);
        let keys: Vec<String> = state
            .entries
            .iter()
            .filter(|(_, (_, l))| *l == Some(lease))
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            self.delete_locked(state, &key);
        }
    }

    fn expire(&self, now: Instant) {
        let mut state = self.lock();
        let expired: Vec<i64> = state
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for lease in expired {
            self.drop_lease(&mut state, lease);
        }
    }
}

/// A [`Registry`] held in memory; clones share the same store. Leases expire like etcd's
/// (checked every 100 ms).
#[derive(Debug, Clone)]
pub struct InProcessRegistry {
    inner: Arc<Inner>,
}

impl Default for InProcessRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl InProcessRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                changes: broadcast::channel(HISTORY).0,
                sweeping: AtomicBool::new(false),
            }),
        }
    }

    /// Starts the lease sweeper once (it stops when the registry is dropped).
    fn ensure_sweeper(&self) {
        if self.inner.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SWEEP_EVERY).await;
                let Some(inner) = weak.upgrade() else { return };
                inner.expire(Instant::now());
            }
        });
    }
}

#[async_trait]
impl Registry for InProcessRegistry {
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, ControlError> {
        self.ensure_sweeper();
        let ttl = Duration::from_secs(ttl.as_secs().max(1));
        let mut state = self.inner.lock();
        state.next_lease += 1;
        let id = state.next_lease;
        state.leases.insert(
            id,
            Lease {
                ttl,
                deadline: Instant::now() + ttl,
            },
        );
        Ok(LeaseId(id))
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, ControlError> {
        self.inner.expire(Instant::now());
        let mut state = self.inner.lock();
        let entry = state
            .leases
            .get_mut(&lease.0)
            .ok_or(ControlError::LeaseNotFound(lease.0))?;
        entry.deadline = Instant::now() + entry.ttl;
        Ok(entry.ttl)
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), ControlError> {
        let mut state = self.inner.lock();
        if !state.leases.contains_key(&lease.0) {
            return Err(ControlError::LeaseNotFound(lease.0));
        }
        self.inner.drop_lease(&mut state, lease.0);
        Ok(())
    }

    async fn put(
        &self,
        key: &str,
        record: &InstanceRecord,
        lease: Option<LeaseId>,
    ) -> Result<(), ControlError> {
        self.inner.expire(Instant::now());
        let mut state = self.inner.lock();
        if let Some(lease) = lease
            && !state.leases.contains_key(&lease.0)
        {
            return Err(ControlError::LeaseNotFound(lease.0));
        }
        let value = Bytes::from(record.to_json());
        state
            .entries
            .insert(key.to_owned(), (value.clone(), lease.map(|l| l.0)));
        self.inner
            .record(&mut state, RawChange::Put(key.to_owned(), value));
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<(), ControlError> {
        let mut state = self.inner.lock();
        self.inner.delete_locked(&mut state, key);
        Ok(())
    }

    async fn list(&self, prefix: &str) -> Result<Listing, ControlError> {
        list_records(self, prefix).await
    }

    fn watch(&self, prefix: &str) -> Watch {
        spawn_watch(self.clone(), prefix.to_owned())
    }
}

#[async_trait]
impl WatchSource for InProcessRegistry {
    async fn list_raw(&self, prefix: &str) -> Result<(Vec<(String, Bytes)>, i64), ControlError> {
        let state = self.inner.lock();
        let entries = state
            .entries
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect();
        Ok((entries, state.revision))
    }

    async fn watch_raw(
        &self,
        prefix: &str,
        revision: i64,
    ) -> Result<Box<dyn RawStream>, ControlError> {
        let state = self.inner.lock();
        let rx = self.inner.changes.subscribe();
        let oldest = state
            .history
            .front()
            .map_or(state.revision + 1, |(r, _)| *r);
        if revision < oldest && revision <= state.revision {
            return Err(ControlError::Server {
                backend: "in-process registry",
                message: format!("revision {revision} was compacted"),
            });
        }
        let pending = state
            .history
            .iter()
            .filter(|(r, _)| *r >= revision)
            .cloned()
            .collect();
        Ok(Box::new(InProcessStream {
            prefix: prefix.to_owned(),
            pending,
            next_revision: revision.max(state.revision + 1),
            rx,
        }))
    }
}

struct InProcessStream {
    prefix: String,
    pending: VecDeque<(i64, RawChange)>,
    /// Broadcast changes below this revision were already served from the history.
    next_revision: i64,
    rx: broadcast::Receiver<(i64, RawChange)>,
}

impl InProcessStream {
    fn matches(&self, change: &RawChange) -> bool {
        match change {
            RawChange::Put(key, _) | RawChange::Delete(key) => key.starts_with(&self.prefix),
        }
    }
}

#[async_trait]
impl RawStream for InProcessStream {
    async fn next(&mut self) -> Result<Option<Vec<RawChange>>, ControlError> {
        while let Some((_, change)) = self.pending.pop_front() {
            if self.matches(&change) {
                return Ok(Some(vec![change]));
            }
        }
        loop {
            match self.rx.recv().await {
                Ok((revision, change)) => {
                    if revision < self.next_revision || !self.matches(&change) {
                        continue;
                    }
                    return Ok(Some(vec![change]));
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    return Err(ControlError::Server {
                        backend: "in-process registry",
                        message: format!("watch fell {n} changes behind"),
                    });
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(None),
            }
        }
    }
}

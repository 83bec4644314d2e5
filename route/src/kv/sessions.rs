//! Session affinity: the requests of one session (the same value of `kv.session_header`) go
//! to the instance the session is bound to, for `kv.session_ttl` after its last request.
//! A bound instance that is busy or unavailable yields: the cost decides, and the session is
//! bound to the new instance.
//!
//! Bindings are shared between proxy replicas: each new or moved binding (and a refresh once
//! half its TTL has passed) goes to the outbox, which the proxy's control plane publishes on
//! the event bus; bindings other replicas publish come in through [`Sessions::apply`]. Best
//! effort, like Dynamo's: a lost message costs one request its affinity, never an error.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

/// Most sessions remembered per model; past it, the expired ones are dropped, then the
/// oldest.
const MAX_SESSIONS: usize = 100_000;

/// A session bound to an instance, as replicas share it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionBinding {
    /// The session key.
    pub session: Arc<str>,
    /// The instance it is bound to.
    pub instance: u64,
    /// How long the binding lasts from now.
    pub ttl: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Bound {
    instance: u64,
    until: Instant,
    /// When this replica last told the others.
    shared: Instant,
}

/// One model's session bindings.
#[derive(Debug)]
pub(crate) struct Sessions {
    /// The request header naming a session (lowercase).
    header: String,
    ttl: Duration,
    bound: Mutex<HashMap<Arc<str>, Bound>>,
    outbox: OnceLock<mpsc::UnboundedSender<SessionBinding>>,
}

impl Sessions {
    /// Sessions named by request header `header`, bound for `ttl` after their last
    /// request; not shared (yet).
    pub(crate) fn new(header: &str, ttl: Duration) -> Self {
        Self {
            header: header.to_ascii_lowercase(),
            ttl,
            bound: Mutex::new(HashMap::new()),
            outbox: OnceLock::new(),
        }
    }

    /// The request header naming a session.
    pub(crate) fn header(&self) -> &str {
        &self.header
    }

    /// From now on, new and moved bindings (and refreshes past half their TTL) are sent to
    /// the returned receiver, for the other replicas; `None` when they already are.
    pub(crate) fn share(&self) -> Option<mpsc::UnboundedReceiver<SessionBinding>> {
        let (outbox, shared) = mpsc::unbounded_channel();
        self.outbox.set(outbox).ok()?;
        Some(shared)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Bound>> {
        self.bound.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The instance `session` is bound to at `now`, if any.
    pub(crate) fn bound(&self, session: &str, now: Instant) -> Option<u64> {
        self.lock()
            .get(session)
            .filter(|bound| bound.until > now)
            .map(|bound| bound.instance)
    }

    /// A request of `session` went to `instance` at `now`: binds it there for the TTL.
    pub(crate) fn bind(&self, session: &Arc<str>, instance: u64, now: Instant) {
        let until = now + self.ttl;
        let share = {
            let mut bound = self.lock();
            match bound.get_mut(&**session) {
                Some(old) if old.instance == instance && old.until > now => {
                    old.until = until;
                    let stale = now.saturating_duration_since(old.shared) >= self.ttl / 2;
                    if stale {
                        old.shared = now;
                    }
                    stale
                }
                _ => {
                    make_room(&mut bound, now);
                    bound.insert(
                        Arc::clone(session),
                        Bound {
                            instance,
                            until,
                            shared: now,
                        },
                    );
                    true
                }
            }
        };
        if share && let Some(outbox) = self.outbox.get() {
            // The receiver lives as long as the proxy; a closed one means it is shutting down.
            let _ = outbox.send(SessionBinding {
                session: Arc::clone(session),
                instance,
                ttl: self.ttl,
            });
        }
    }

    /// Takes in a binding another replica made, arriving at `now`.
    pub(crate) fn apply(&self, binding: SessionBinding, now: Instant) {
        let mut bound = self.lock();
        make_room(&mut bound, now);
        bound.insert(
            binding.session,
            Bound {
                instance: binding.instance,
                until: now + binding.ttl.min(self.ttl),
                shared: now,
            },
        );
    }

    /// Forgets every binding to `instance` (it left the pool).
    pub(crate) fn remove_instance(&self, instance: u64) {
        self.lock().retain(|_, bound| bound.instance != instance);
    }

    /// Drops the bindings expired at `now`.
    pub(crate) fn expire(&self, now: Instant) {
        self.lock().retain(|_, bound| bound.until > now);
    }
}

/// Keeps `bound` under [`MAX_SESSIONS`]: the expired bindings go first, then the ones
/// closest to expiry.
fn make_room(bound: &mut HashMap<Arc<str>, Bound>, now: Instant) {
    if bound.len() < MAX_SESSIONS {
        return;
    }
    bound.retain(|_, b| b.until > now);
    if bound.len() < MAX_SESSIONS {
        return;
    }
    let mut ends: Vec<Instant> = bound.values().map(|b| b.until).collect();
    let cut = MAX_SESSIONS / 10;
    let (_, &mut nth, _) = ends.select_nth_unstable(cut);
    bound.retain(|_, b| b.until > nth);
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(60);

    fn key(text: &str) -> Arc<str> {
        Arc::from(text)
    }

    #[test]
    fn a_binding_lasts_its_ttl_after_the_last_request() {
        let sessions = Sessions::new("x-session-id", TTL);
        let start = Instant::now();
        assert_eq!(sessions.bound("a", start), None);
        sessions.bind(&key("a"), 3, start);
        assert_eq!(sessions.bound("a", start + TTL / 2), Some(3));
        sessions.bind(&key("a"), 3, start + TTL / 2);
        assert_eq!(sessions.bound("a", start + TTL), Some(3));
        assert_eq!(sessions.bound("a", start + TTL / 2 + TTL), None);
        assert_eq!(sessions.bound("b", start), None);
        sessions.bind(&key("a"), 5, start + TTL);
        assert_eq!(sessions.bound("a", start + TTL), Some(5));
        sessions.remove_instance(5);
        assert_eq!(sessions.bound("a", start + TTL), None);
    }

    #[test]
    fn new_moved_and_half_stale_bindings_are_shared_once() {
        let sessions = Sessions::new("x-session-id", TTL);
        let mut shared = sessions.share().unwrap();
        assert!(sessions.share().is_none(), "once");
        let start = Instant::now();
        sessions.bind(&key("a"), 1, start);
        sessions.bind(&key("a"), 1, start + Duration::from_secs(1));
        sessions.bind(&key("a"), 2, start + Duration::from_secs(2));
        sessions.bind(&key("a"), 2, start + Duration::from_secs(2) + TTL / 2);
        let mut got = Vec::new();
        while let Ok(binding) = shared.try_recv() {
            got.push(binding.instance);
        }
        assert_eq!(got, [1, 2, 2]);
    }

    #[test]
    fn other_replicas_bindings_apply_and_expire() {
        let sessions = Sessions::new("x-session-id", TTL);
        let now = Instant::now();
        sessions.apply(
            SessionBinding {
                session: key("s"),
                instance: 7,
                ttl: Duration::from_secs(10),
            },
            now,
        );
        assert_eq!(sessions.bound("s", now), Some(7));
        sessions.expire(now + Duration::from_secs(11));
        assert_eq!(sessions.bound("s", now), None);
    }

    #[test]
    fn the_table_stays_bounded() {
        let sessions = Sessions::new("x-session-id", TTL);
        let now = Instant::now();
        for i in 0..MAX_SESSIONS + 10 {
            sessions.bind(
                &key(&i.to_string()),
                1,
                now + Duration::from_millis(i as u64),
            );
        }
        let len = sessions.lock().len();
        assert!(len <= MAX_SESSIONS, "{len}");
        assert_eq!(
            sessions.bound(&(MAX_SESSIONS + 9).to_string(), now),
            Some(1)
        );
    }
}

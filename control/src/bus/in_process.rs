//! [`EventBus`] inside one process (the demo's embedded default): subject-routed channels with
//! NATS wildcard semantics; always connected.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::watch;

use super::subject::{subject_matches, validate_subject};
use super::{
    ConnectionState, EventBus, Inbox, Message, SUBSCRIPTION_BUFFER, Subscription, SubscriptionEnd,
};
use crate::error::ControlError;

#[derive(Debug)]
struct Sub {
    sid: u64,
    pattern: String,
    inbox: Inbox,
}

#[derive(Debug)]
struct Inner {
    subs: RwLock<Vec<Sub>>,
    next_sid: AtomicU64,
    state: watch::Sender<ConnectionState>,
}

impl Inner {
    fn deliver(&self, subject: &str, reply: Option<&str>, payload: Bytes) {
        let subs = self.subs.read().unwrap_or_else(PoisonError::into_inner);
        for sub in subs.iter().filter(|s| subject_matches(&s.pattern, subject)) {
            let msg = Message {
                subject: subject.to_owned(),
                reply: reply.map(str::to_owned),
                payload: payload.clone(),
            };
            sub.inbox.deliver(msg);
        }
    }

    fn add(&self, pattern: &str) -> (u64, SubscriptionEnd) {
        let sid = self.next_sid.fetch_add(1, Ordering::Relaxed);
        let (inbox, end) = Inbox::new(SUBSCRIPTION_BUFFER);
        self.subs
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Sub {
                sid,
                pattern: pattern.to_owned(),
                inbox,
            });
        (sid, end)
    }
}

/// An [`EventBus`] within one process; clones share the same subjects.
#[derive(Debug, Clone)]
pub struct InProcessBus {
    inner: Arc<Inner>,
}

impl Default for InProcessBus {
    fn default() -> Self {
        Self::new()
    }
}

impl InProcessBus {
    /// A bus with no subscribers.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                subs: RwLock::new(Vec::new()),
                next_sid: AtomicU64::new(1),
                state: watch::channel(ConnectionState::Connected { epoch: 1 }).0,
            }),
        }
    }

    fn subscription(&self, pattern: &str) -> Subscription {
        let (sid, rx) = self.inner.add(pattern);
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        Subscription::new(
            rx,
            Box::new(move || {
                if let Some(inner) = weak.upgrade() {
                    inner
                        .subs
                        .write()
                        .unwrap_or_else(PoisonError::into_inner)
                        .retain(|s| s.sid != sid);
                }
            }),
        )
    }
}

#[async_trait]
impl EventBus for InProcessBus {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), ControlError> {
        validate_subject(subject, false)?;
        self.inner.deliver(subject, None, payload);
        Ok(())
    }

    async fn subscribe(&self, subject: &str) -> Result<Subscription, ControlError> {
        validate_subject(subject, true)?;
        Ok(self.subscription(subject))
    }

    async fn request_replies(
        &self,
        subject: &str,
        payload: Bytes,
    ) -> Result<Subscription, ControlError> {
        validate_subject(subject, false)?;
        let inbox = format!(
            "_INBOX.local.{}",
            self.inner.next_sid.fetch_add(1, Ordering::Relaxed)
        );
        let replies = self.subscription(&inbox);
        self.inner.deliver(subject, Some(&inbox), payload);
        Ok(replies)
    }

    fn connection_state(&self) -> watch::Receiver<ConnectionState> {
        self.inner.state.subscribe()
    }
}

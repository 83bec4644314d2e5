//! The event plane: the [`EventBus`] trait (publish, subscribe, request-reply, a connection
//! state signal) and its NATS and in-process implementations.

mod in_process;
#[cfg(feature = "transports")]
mod nats;
mod subject;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::Stream;
use tokio::sync::{mpsc, watch};

pub use in_process::InProcessBus;
#[cfg(feature = "transports")]
pub use nats::{DurableStream, NatsBus, NatsSettings};
pub use subject::{subject_matches, validate_subject};

use crate::error::ControlError;

/// Messages a subscription buffers before newer ones are dropped (and counted in the logs):
/// a slow consumer must not stall every other subscription of the connection.
pub const SUBSCRIPTION_BUFFER: usize = 8192;

/// One message received on a subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The subject it was published on.
    pub subject: String,
    /// Where to send an answer, for requests.
    pub reply: Option<String>,
    /// The payload.
    pub payload: Bytes,
}

/// The bus connection's state, observed through [`EventBus::connection_state`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionState {
    /// Connected; `epoch` counts connections (1 for the first). A larger epoch than the last
    /// one seen means the connection came back and messages may have been missed: resync.
    Connected {
        /// 1 for the first connection, +1 per reconnect.
        epoch: u64,
    },
    /// Not connected; publishing fails, subscriptions are restored on reconnect.
    Disconnected,
}

/// Unsubscribes when a [`Subscription`] is dropped.
pub(crate) type Unsubscribe = Box<dyn FnOnce() + Send + Sync>;

/// The bus's side of a subscription: hands messages over without waiting, and counts those
/// dropped because the subscriber fell `capacity` messages behind.
#[derive(Debug)]
pub(crate) struct Inbox {
    tx: mpsc::Sender<Message>,
    dropped: Arc<AtomicU64>,
}

/// What became of a message handed to an [`Inbox`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Queued for the subscriber.
    Queued,
    /// Dropped: the subscriber's buffer is full.
    Dropped,
    /// The subscription is gone.
    Closed,
}

impl Inbox {
    /// An inbox of `capacity` messages and the subscription end of it.
    pub(crate) fn new(capacity: usize) -> (Self, SubscriptionEnd) {
        let (tx, rx) = mpsc::channel(capacity);
        let dropped = Arc::new(AtomicU64::new(0));
        let end = SubscriptionEnd {
            rx,
            dropped: Arc::clone(&dropped),
        };
        (Self { tx, dropped }, end)
    }

    /// Queues `message`; when the subscriber is full it is dropped, counted, and logged at
    /// the 1st, 2nd, 4th, 8th... drop (a flood of drops is not a flood of log lines).
    pub(crate) fn deliver(&self, message: Message) -> Delivery {
        match self.tx.try_send(message) {
            Ok(()) => Delivery::Queued,
            Err(mpsc::error::TrySendError::Full(message)) => {
                let dropped = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                if dropped.is_power_of_two() {
                    tracing::warn!(subject = %message.subject, dropped, "subscriber is full; messages dropped");
                }
                Delivery::Dropped
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Delivery::Closed,
        }
    }
}

/// The subscriber's end of an [`Inbox`], made into a [`Subscription`].
#[derive(Debug)]
pub(crate) struct SubscriptionEnd {
    rx: mpsc::Receiver<Message>,
    dropped: Arc<AtomicU64>,
}

/// The messages of one subscription (or of [`EventBus::serve`]), until dropped.
pub struct Subscription {
    rx: mpsc::Receiver<Message>,
    dropped: Arc<AtomicU64>,
    unsubscribe: Option<Unsubscribe>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}

impl Subscription {
    pub(crate) fn new(end: SubscriptionEnd, unsubscribe: Unsubscribe) -> Self {
        Self {
            rx: end.rx,
            dropped: end.dropped,
            unsubscribe: Some(unsubscribe),
        }
    }

    /// The next message; `None` once the bus is shut down.
    pub async fn next(&mut self) -> Option<Message> {
        self.rx.recv().await
    }

    /// Messages dropped so far because this subscriber was [`SUBSCRIPTION_BUFFER`] messages
    /// behind (delivery is at most once; consumers of numbered batches see the gap too).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl Stream for Subscription {
    type Item = Message;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(unsubscribe) = self.unsubscribe.take() {
            unsubscribe();
        }
    }
}

/// Publish/subscribe with request-reply. Object-safe: use `Arc<dyn EventBus>`.
///
/// Subjects are NATS subjects: `.`-separated tokens; subscriptions may use `*` (one token)
/// and `>` (the rest). Delivery is at most once: a consumer notices losses through the
/// batches' sequence numbers and through [`ConnectionState`] epochs.
#[async_trait]
pub trait EventBus: Send + Sync + 'static {
    /// Publishes `payload` on `subject`. Fails at once with
    /// [`ControlError::Disconnected`] while the connection is down (nothing is queued).
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), ControlError>;

    /// Receives every message published on subjects matching `subject` from now on; kept
    /// across reconnects.
    async fn subscribe(&self, subject: &str) -> Result<Subscription, ControlError>;

    /// Sends a request and returns the subscription its replies arrive on (several, for an
    /// answer that comes in parts), until dropped. The subscription ends early when the
    /// server says that no one serves `subject`.
    async fn request_replies(
        &self,
        subject: &str,
        payload: Bytes,
    ) -> Result<Subscription, ControlError>;

    /// Sends a request and waits up to `timeout` for the first reply.
    async fn request(
        &self,
        subject: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, ControlError> {
        let mut replies = self.request_replies(subject, payload).await?;
        match tokio::time::timeout(timeout, replies.next()).await {
            Ok(Some(message)) => Ok(message.payload),
            Ok(None) => Err(ControlError::NoResponders(subject.to_owned())),
            Err(_) => Err(ControlError::Timeout("request")),
        }
    }

    /// Publishes and waits until the message is stored for durable subscribers (NATS with a
    /// JetStream stream); elsewhere the same as [`EventBus::publish`].
    async fn publish_durable(&self, subject: &str, payload: Bytes) -> Result<(), ControlError> {
        self.publish(subject, payload).await
    }

    /// Receives what is published on `subject` from now on, across reconnects without a
    /// loss when [`EventBus::is_durable`]; elsewhere the same as [`EventBus::subscribe`].
    async fn subscribe_durable(&self, subject: &str) -> Result<Subscription, ControlError> {
        self.subscribe(subject).await
    }

    /// Whether durable subscriptions lose nothing across reconnects (and durable publishes
    /// are stored before they return).
    fn is_durable(&self) -> bool {
        false
    }

    /// The largest payload a message may carry.
    fn max_payload(&self) -> usize {
        usize::MAX
    }

    /// The requests sent to `subject`: messages whose [`Message::reply`] says where to answer,
    /// with [`EventBus::reply`].
    async fn serve(&self, subject: &str) -> Result<Subscription, ControlError> {
        self.subscribe(subject).await
    }

    /// Answers a request received through [`EventBus::serve`] (does nothing for a message
    /// without a reply subject).
    async fn reply(&self, request: &Message, payload: Bytes) -> Result<(), ControlError> {
        match &request.reply {
            Some(reply) => self.publish(reply, payload).await,
            None => Ok(()),
        }
    }

    /// The connection state now and its changes.
    fn connection_state(&self) -> watch::Receiver<ConnectionState>;
}

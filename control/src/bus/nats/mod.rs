//! [`EventBus`] on NATS core, through a small client of the NATS text protocol (CONNECT, PUB,
//! SUB, UNSUB, MSG, PING/PONG; request-reply through a per-request `_INBOX` subscription).
//! No TLS, no auth, no headers, no JetStream. Reconnects forever with backoff (100 ms doubling
//! to 5 s) and restores subscriptions; [`EventBus::connection_state`] reports each connection
//! with a growing epoch.

mod conn;
mod proto;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use self::conn::{Command, Shared};
use super::subject::validate_subject;
use super::{ConnectionState, EventBus, Inbox, SUBSCRIPTION_BUFFER, Subscription};
use crate::error::ControlError;

/// NATS's default port.
const DEFAULT_PORT: u16 = 4222;
/// The server's default payload limit, assumed until its INFO says otherwise.
const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;
/// How long [`NatsBus::connect`] waits for the first connection.
const FIRST_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `subscribe` waits for the server to confirm the subscription.
const SUBSCRIBE_CONFIRM_TIMEOUT: Duration = Duration::from_secs(2);
/// Commands queued for the connection task before `publish` waits.
const COMMAND_QUEUE: usize = 8192;

/// `nats://host:port`, `host:port` or `nats://host` → `host:port`.
fn server_address(url: &str) -> Result<String, ControlError> {
    let rest = match url.split_once("://") {
        Some(("nats", rest)) => rest,
        Some((scheme, _)) => {
            return Err(ControlError::InvalidName(format!(
                "NATS URL {url:?}: scheme {scheme:?} is not supported (use nats://)"
            )));
        }
        None => url,
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains(['/', '@', ',']) {
        return Err(ControlError::InvalidName(format!(
            "NATS URL {url:?}: expected nats://host:port (no credentials, one server)"
        )));
    }
    let has_port = rest
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.ends_with(':') && port.parse::<u16>().is_ok());
    Ok(if has_port {
        rest.to_owned()
    } else {
        format!("{rest}:{DEFAULT_PORT}")
    })
}

struct Client {
    cmds: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    next_sid: AtomicU64,
    inbox_prefix: String,
    task: JoinHandle<()>,
}

impl Drop for Client {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The NATS-backed [`EventBus`]; clones share one connection.
#[derive(Clone)]
pub struct NatsBus {
    client: Arc<Client>,
}

impl std::fmt::Debug for NatsBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsBus")
            .field("state", &*self.client.shared.state.borrow())
            .finish_non_exhaustive()
    }
}

impl NatsBus {
    /// Connects to the server at `url` (`nats://host:port`), waiting up to 5 s for the first
    /// connection; afterwards it reconnects on its own. `name` shows in the server's
    /// connection list.
    pub async fn connect(url: &str, name: &str) -> Result<Self, ControlError> {
        let addr = server_address(url)?;
        let (cmds, rx) = mpsc::channel(COMMAND_QUEUE);
        let shared = Arc::new(Shared {
            state: watch::channel(ConnectionState::Disconnected).0,
            max_payload: AtomicUsize::new(DEFAULT_MAX_PAYLOAD),
        });
        let mut state = shared.state.subscribe();
        let task = tokio::spawn(conn::run(addr.clone(), name.to_owned(), rx, shared.clone()));
        let bus = Self {
            client: Arc::new(Client {
                cmds,
                shared,
                next_sid: AtomicU64::new(1),
                inbox_prefix: format!("_INBOX.{:016x}", rand::random::<u64>()),
                task,
            }),
        };
        let connected = tokio::time::timeout(
            FIRST_CONNECT_TIMEOUT,
            state.wait_for(|s| matches!(s, ConnectionState::Connected { .. })),
        )
        .await;
        match connected {
            Ok(Ok(_)) => Ok(bus),
            _ => Err(ControlError::Transport {
                backend: "nats",
                message: format!("cannot connect to {addr}"),
            }),
        }
    }

    /// The largest payload the server accepts (from its INFO).
    pub fn max_payload(&self) -> usize {
        self.client.shared.max_payload.load(Ordering::Relaxed)
    }

    fn is_connected(&self) -> bool {
        matches!(
            *self.client.shared.state.borrow(),
            ConnectionState::Connected { .. }
        )
    }

    async fn send(&self, cmd: Command) -> Result<(), ControlError> {
        self.client
            .cmds
            .send(cmd)
            .await
            .map_err(|_| ControlError::Closed)
    }

    async fn publish_with_reply(
        &self,
        subject: &str,
        reply: Option<String>,
        payload: Bytes,
    ) -> Result<(), ControlError> {
        validate_subject(subject, false)?;
        if !self.is_connected() {
            return Err(ControlError::Disconnected("nats"));
        }
        let limit = self.max_payload();
        if payload.len() > limit {
            return Err(ControlError::PayloadTooLarge {
                size: payload.len(),
                limit,
            });
        }
        self.send(Command::Publish {
            subject: subject.to_owned(),
            reply,
            payload,
        })
        .await
    }

    /// Waits until the server has processed everything sent so far (a PING/PONG round trip),
    /// up to `timeout`; returns at once while disconnected.
    pub async fn flush(&self, timeout: Duration) -> Result<(), ControlError> {
        if !self.is_connected() {
            return Err(ControlError::Disconnected("nats"));
        }
        let (done, wait) = oneshot::channel();
        self.send(Command::Flush(done)).await?;
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(ControlError::Disconnected("nats")),
            Err(_) => Err(ControlError::Timeout("nats flush")),
        }
    }
}

#[async_trait]
impl EventBus for NatsBus {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), ControlError> {
        self.publish_with_reply(subject, None, payload).await
    }

    /// Subscribes and, while connected, waits (up to 2 s) until the server confirms, so
    /// messages published after this returns are received.
    async fn subscribe(&self, subject: &str) -> Result<Subscription, ControlError> {
        validate_subject(subject, true)?;
        let sid = self.client.next_sid.fetch_add(1, Ordering::Relaxed);
        let (inbox, end) = Inbox::new(SUBSCRIPTION_BUFFER);
        self.send(Command::Subscribe {
            sid,
            subject: subject.to_owned(),
            inbox,
        })
        .await?;
        let cmds = self.client.cmds.clone();
        let subscription = Subscription::new(
            end,
            Box::new(move || {
                // If the queue is full the task drops the subscription when it finds the
                // receiver closed.
                let _ = cmds.try_send(Command::Unsubscribe { sid });
            }),
        );
        if self.is_connected() {
            // A disconnect meanwhile is fine: the subscription is restored on reconnect.
            let _ = self.flush(SUBSCRIBE_CONFIRM_TIMEOUT).await;
        }
        Ok(subscription)
    }

    async fn request(
        &self,
        subject: &str,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, ControlError> {
        validate_subject(subject, false)?;
        if !self.is_connected() {
            return Err(ControlError::Disconnected("nats"));
        }
        let inbox = format!(
            "{}.{}",
            self.client.inbox_prefix,
            self.client.next_sid.fetch_add(1, Ordering::Relaxed)
        );
        let sid = self.client.next_sid.fetch_add(1, Ordering::Relaxed);
        let (replies_inbox, end) = Inbox::new(1);
        // No confirmation round trip: the SUB reaches the server before the PUB on the same
        // connection.
        self.send(Command::Subscribe {
            sid,
            subject: inbox.clone(),
            inbox: replies_inbox,
        })
        .await?;
        let cmds = self.client.cmds.clone();
        let mut replies = Subscription::new(
            end,
            Box::new(move || {
                let _ = cmds.try_send(Command::Unsubscribe { sid });
            }),
        );
        self.publish_with_reply(subject, Some(inbox), payload)
            .await?;
        match tokio::time::timeout(timeout, replies.next()).await {
            Ok(Some(msg)) => Ok(msg.payload),
            Ok(None) => Err(ControlError::Closed),
            Err(_) => Err(ControlError::Timeout("nats request")),
        }
    }

    fn connection_state(&self) -> watch::Receiver<ConnectionState> {
        self.client.shared.state.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_become_addresses() {
        assert_eq!(
            server_address("nats://127.0.0.1:4222").ok().as_deref(),
            Some("127.0.0.1:4222")
        );
        assert_eq!(
            server_address("127.0.0.1:5000").ok().as_deref(),
            Some("127.0.0.1:5000")
        );
        assert_eq!(
            server_address("nats://localhost").ok().as_deref(),
            Some("localhost:4222")
        );
        assert!(server_address("tls://x:1").is_err());
        assert!(server_address("nats://u:p@x:1").is_err());
        assert!(server_address("nats://a:1,b:2").is_err());
        assert!(server_address("").is_err());
    }
}

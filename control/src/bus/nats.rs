//! [`EventBus`] on NATS through `async-nats`: TLS (a CA, mutual TLS), token, user and
//! password, NKey and creds-file auth ([`NatsSettings`]), request-reply through `_INBOX`
//! subscriptions. The client reconnects forever (100 ms doubling to 5 s) and restores
//! subscriptions; [`EventBus::connection_state`] reports each connection with a growing epoch.
//! With a [`DurableStream`], the durable calls go through a JetStream stream: publishing
//! waits for the stream to store the message, and a durable subscription is an ordered
//! consumer that resumes after the last message it delivered when the connection comes back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::{ConnectOptions, Event, ServerAddr, StatusCode};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::watch;

use super::subject::validate_subject;
use super::{
    ConnectionState, Delivery, EventBus, Inbox, Message, SUBSCRIPTION_BUFFER, Subscription,
};
use crate::error::ControlError;
use crate::security::{NatsAuth, TlsFiles, read_pem, read_secret};

const BACKEND: &str = "nats";
/// Messages the client buffers per subscription before its forwarder moves them into the
/// subscription's [`Inbox`]: far more than the inbox holds, so that a slow subscriber's
/// losses happen (and are counted) there.
const CLIENT_SUBSCRIPTION_BUFFER: usize = 8 * SUBSCRIPTION_BUFFER;
/// How long [`NatsBus::connect_with`] waits for the first connection.
const FIRST_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one connection attempt may take (TCP, TLS and the CONNECT handshake).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);
/// How long `subscribe` waits for the server to confirm the subscription.
const SUBSCRIBE_CONFIRM_TIMEOUT: Duration = Duration::from_secs(2);
/// First pause before reconnecting; doubles per failed attempt.
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
/// Longest pause between reconnect attempts.
const RECONNECT_MAX: Duration = Duration::from_secs(5);

fn transport(error: impl std::fmt::Display) -> ControlError {
    ControlError::Transport {
        backend: BACKEND,
        message: error.to_string(),
    }
}

/// How long a durable publish waits for the stream's acknowledgement.
const DURABLE_ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// A JetStream stream that keeps messages for durable subscribers (made when missing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurableStream {
    /// The stream's name.
    pub name: String,
    /// The subjects it stores (wildcards allowed).
    pub subjects: Vec<String>,
    /// How long it keeps a message.
    pub max_age: Duration,
}

/// The JetStream side of a [`NatsBus`].
#[derive(Clone)]
struct Durable {
    client: async_nats::Client,
    context: async_nats::jetstream::Context,
    stream: DurableStream,
}

/// Where a [`NatsBus`] connects and how it proves itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsSettings {
    /// Server URLs, comma-separated: `nats://host:port` (or `host:port`), `tls://host:port`
    /// for TLS from the first byte's handshake. Credentials do not go in the URL.
    pub url: String,
    /// The connection's name in the server's connection list.
    pub name: String,
    /// TLS; `None` with `nats://` URLs means plaintext unless the server requires TLS.
    pub tls: Option<TlsFiles>,
    /// Credentials.
    pub auth: NatsAuth,
    /// A JetStream stream for the durable calls; `None`: they act as the plain ones.
    pub durable: Option<DurableStream>,
    /// How often the client PINGs the server when nothing else arrives. The client gives
    /// the connection up (and reconnects) when a third PING would go out unanswered, so a
    /// server that hangs without closing the connection is noticed within three of these.
    pub ping_interval: Duration,
}

/// [`NatsSettings::ping_interval`] unless set: async-nats's own 60 s would notice a hung
/// server after three minutes.
const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(2);

impl NatsSettings {
    /// Plaintext, no credentials, no stream.
    pub fn new(url: &str, name: &str) -> Self {
        Self {
            url: url.to_owned(),
            name: name.to_owned(),
            tls: None,
            auth: NatsAuth::None,
            durable: None,
            ping_interval: DEFAULT_PING_INTERVAL,
        }
    }

    /// The server addresses of [`NatsSettings::url`].
    fn servers(&self) -> Result<Vec<ServerAddr>, ControlError> {
        let servers = self
            .url
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(|url| {
                let addr: ServerAddr = url.parse().map_err(|error| {
                    ControlError::Config(format!("NATS URL {url:?}: {error}"))
                })?;
                if addr.has_user_pass() {
                    return Err(ControlError::Config(format!(
                        "NATS URL {url:?} carries credentials: put them in a file and name it in the auth settings"
                    )));
                }
                if matches!(addr.as_url_str().split_once("://"), Some(("ws" | "wss", _))) {
                    return Err(ControlError::Config(format!(
                        "NATS URL {url:?}: websockets are not supported (use nats:// or tls://)"
                    )));
                }
                Ok(addr)
            })
            .collect::<Result<Vec<_>, _>>()?;
        if servers.is_empty() {
            return Err(ControlError::Config("no NATS URL given".to_owned()));
        }
        Ok(servers)
    }

    /// The client options: credentials and TLS files read now, so that a missing file is an
    /// error at startup rather than a reconnect loop.
    async fn options(&self) -> Result<ConnectOptions, ControlError> {
        let options = match &self.auth {
            NatsAuth::None => ConnectOptions::new(),
            NatsAuth::Token { token_file } => {
                ConnectOptions::with_token(read_secret(token_file, "NATS token")?)
            }
            NatsAuth::UserPassword {
                user,
                password_file,
            } => ConnectOptions::with_user_and_password(
                user.clone(),
                read_secret(password_file, "NATS password")?,
            ),
            NatsAuth::Nkey { seed_file } => {
                ConnectOptions::with_nkey(read_secret(seed_file, "NATS nkey seed")?)
            }
            NatsAuth::Credentials { creds_file } => {
                ConnectOptions::with_credentials_file(creds_file)
                    .await
                    .map_err(|error| {
                        ControlError::Config(format!(
                            "cannot read the NATS creds file {}: {error}",
                            creds_file.display()
                        ))
                    })?
            }
        };
        let options = options.ping_interval(self.ping_interval);
        let Some(tls) = &self.tls else {
            return Ok(options);
        };
        let mut options = options.require_tls(true);
        if let Some(ca) = &tls.ca_file {
            read_pem(ca, "NATS CA file")?;
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = tls.client_identity()? {
            read_pem(cert, "NATS client certificate")?;
            read_pem(key, "NATS client key")?;
            options = options.add_client_certificate(cert.to_owned(), key.to_owned());
        }
        Ok(options)
    }
}

/// The NATS-backed [`EventBus`]; clones share one connection.
#[derive(Clone)]
pub struct NatsBus {
    client: async_nats::Client,
    state: Arc<watch::Sender<ConnectionState>>,
    durable: Option<Durable>,
}

impl std::fmt::Debug for NatsBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsBus")
            .field("state", &*self.state.borrow())
            .finish_non_exhaustive()
    }
}

impl NatsBus {
    /// Connects to `url` in plaintext without credentials ([`NatsBus::connect_with`]).
    pub async fn connect(url: &str, name: &str) -> Result<Self, ControlError> {
        Self::connect_with(&NatsSettings::new(url, name)).await
    }

    /// Connects as `settings` say, waiting up to 5 s for the first connection; afterwards
    /// the client reconnects on its own. Refused credentials or certificates fail here.
    pub async fn connect_with(settings: &NatsSettings) -> Result<Self, ControlError> {
        let servers = settings.servers()?;
        let state = Arc::new(watch::channel(ConnectionState::Disconnected).0);
        let epoch = Arc::new(AtomicU64::new(0));
        let events_state = Arc::clone(&state);
        let options = settings
            .options()
            .await?
            .name(&settings.name)
            .subscription_capacity(CLIENT_SUBSCRIPTION_BUFFER)
            .request_timeout(None)
            .max_reconnects(None)
            .connection_timeout(CONNECTION_TIMEOUT)
            .reconnect_delay_callback(reconnect_delay)
            .event_callback(move |event| {
                let state = Arc::clone(&events_state);
                let epoch = Arc::clone(&epoch);
                async move { on_event(&state, &epoch, event) }
            });
        let client = tokio::time::timeout(FIRST_CONNECT_TIMEOUT, options.connect(servers))
            .await
            .map_err(|_| ControlError::Timeout("nats connect"))?
            .map_err(|error| connect_error(&settings.url, &error))?;
        // The Connected event reaches the state through the event task, just after.
        let mut connected = state.subscribe();
        tokio::time::timeout(
            FIRST_CONNECT_TIMEOUT,
            connected.wait_for(|s| matches!(s, ConnectionState::Connected { .. })),
        )
        .await
        .map_err(|_| ControlError::Timeout("nats connect"))?
        .map_err(|_| ControlError::Closed)?;
        let durable = match &settings.durable {
            Some(stream) => Some(Durable::open(&client, stream).await?),
            None => None,
        };
        Ok(Self {
            client,
            state,
            durable,
        })
    }

    /// The largest payload the server accepts (from its INFO).
    pub fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Fails while disconnected (nothing is queued) or when `payload` exceeds the limit.
    fn check_publishable(&self, payload: &Bytes) -> Result<(), ControlError> {
        if !self.is_connected() {
            return Err(ControlError::Disconnected(BACKEND));
        }
        let limit = self.max_payload();
        if payload.len() > limit {
            return Err(ControlError::PayloadTooLarge {
                size: payload.len(),
                limit,
            });
        }
        Ok(())
    }

    /// Waits until the server has processed everything sent so far, up to `timeout`; fails
    /// at once while disconnected. (The client's own flush only empties the socket buffer:
    /// this is a round trip, a message to a fresh inbox of our own that comes back after
    /// every operation sent before it.)
    pub async fn flush(&self, timeout: Duration) -> Result<(), ControlError> {
        if !self.is_connected() {
            return Err(ControlError::Disconnected(BACKEND));
        }
        let round_trip = async {
            let inbox = self.client.new_inbox();
            let mut echo = self
                .client
                .subscribe(inbox.clone())
                .await
                .map_err(transport)?;
            self.client
                .publish(inbox, Bytes::new())
                .await
                .map_err(transport)?;
            echo.next().await.map(drop).ok_or(ControlError::Closed)
        };
        tokio::time::timeout(timeout, round_trip)
            .await
            .map_err(|_| ControlError::Timeout("nats flush"))?
    }

    /// A subscription to `subject`, forwarded into an [`Inbox`]; a status message (no
    /// responders) ends it.
    async fn open(&self, subject: String) -> Result<Subscription, ControlError> {
        let mut subscriber = self.client.subscribe(subject).await.map_err(transport)?;
        let (inbox, end) = Inbox::new(SUBSCRIPTION_BUFFER);
        let task = tokio::spawn(async move {
            while let Some(message) = subscriber.next().await {
                if message.status == Some(StatusCode::NO_RESPONDERS) {
                    break;
                }
                let message = Message {
                    subject: message.subject.to_string(),
                    reply: message.reply.map(|reply| reply.to_string()),
                    payload: message.payload,
                };
                if inbox.deliver(message) == Delivery::Closed {
                    break;
                }
            }
        });
        Ok(Subscription::new(end, Box::new(move || task.abort())))
    }
}

impl Durable {
    /// The stream, made when the server does not have it yet (file storage).
    async fn open(
        client: &async_nats::Client,
        stream: &DurableStream,
    ) -> Result<Self, ControlError> {
        let context = async_nats::jetstream::new(client.clone());
        let config = async_nats::jetstream::stream::Config {
            name: stream.name.clone(),
            subjects: stream.subjects.clone(),
            max_age: stream.max_age,
            storage: async_nats::jetstream::stream::StorageType::File,
            ..Default::default()
        };
        tokio::time::timeout(DURABLE_ACK_TIMEOUT, context.get_or_create_stream(config))
            .await
            .map_err(|_| ControlError::Timeout("jetstream stream"))?
            .map_err(|error| ControlError::Server {
                backend: BACKEND,
                message: format!(
                    "JetStream stream {:?} (is JetStream enabled on the server?): {error}",
                    stream.name
                ),
            })?;
        Ok(Self {
            client: client.clone(),
            context,
            stream: stream.clone(),
        })
    }

    /// An ordered consumer of the stream's messages on `subject` from now on, forwarded
    /// into a [`Subscription`]; it resumes after its last message when the connection or
    /// the consumer is lost.
    async fn subscribe(&self, subject: &str) -> Result<Subscription, ControlError> {
        let server = |error: &dyn std::fmt::Display| ControlError::Server {
            backend: BACKEND,
            message: format!("JetStream stream {:?}: {error}", self.stream.name),
        };
        let stream = self
            .context
            .get_stream(&self.stream.name)
            .await
            .map_err(|error| server(&error))?;
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::push::OrderedConfig {
                deliver_subject: self.client.new_inbox(),
                filter_subject: subject.to_owned(),
                deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::New,
                ..Default::default()
            })
            .await
            .map_err(|error| server(&error))?;
        let mut messages = consumer.messages().await.map_err(|error| server(&error))?;
        let (inbox, end) = Inbox::new(SUBSCRIPTION_BUFFER);
        let task = tokio::spawn(async move {
            while let Some(next) = messages.next().await {
                match next {
                    Ok(message) => {
                        let message = Message {
                            subject: message.message.subject.to_string(),
                            reply: None,
                            payload: message.message.payload,
                        };
                        if inbox.deliver(message) == Delivery::Closed {
                            break;
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "JetStream consumer error; it resumes by itself");
                    }
                }
            }
        });
        Ok(Subscription::new(end, Box::new(move || task.abort())))
    }
}

/// A failed first connection: [`ControlError::Refused`] when the server refused the
/// credentials, else a transport error.
fn connect_error(url: &str, error: &async_nats::ConnectError) -> ControlError {
    let message = format!("cannot connect to {url}: {error}");
    match error.kind() {
        async_nats::ConnectErrorKind::AuthorizationViolation
        | async_nats::ConnectErrorKind::Authentication => ControlError::Refused {
            backend: BACKEND,
            message,
        },
        _ => transport(message),
    }
}

/// 100 ms before the first reconnect attempt, doubling up to 5 s.
fn reconnect_delay(attempts: usize) -> Duration {
    let doublings = u32::try_from(attempts.saturating_sub(1))
        .unwrap_or(u32::MAX)
        .min(16);
    (RECONNECT_FIRST * 2u32.pow(doublings)).min(RECONNECT_MAX)
}

/// Turns the client's events into [`ConnectionState`]s and log lines.
fn on_event(state: &watch::Sender<ConnectionState>, epoch: &AtomicU64, event: Event) {
    match event {
        Event::Connected => {
            let epoch = epoch.fetch_add(1, Ordering::Relaxed) + 1;
            state.send_replace(ConnectionState::Connected { epoch });
        }
        Event::Disconnected => {
            state.send_replace(ConnectionState::Disconnected);
        }
        Event::ServerError(error) => tracing::warn!(%error, "NATS server error"),
        Event::ClientError(error) => tracing::warn!(%error, "NATS client error"),
        Event::SlowConsumer(sid) => {
            tracing::warn!(sid, "NATS subscription is full; messages dropped");
        }
        other => tracing::debug!(event = %other, "NATS event"),
    }
}

#[async_trait]
impl EventBus for NatsBus {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), ControlError> {
        validate_subject(subject, false)?;
        self.check_publishable(&payload)?;
        self.client
            .publish(subject.to_owned(), payload)
            .await
            .map_err(transport)
    }

    /// Subscribes and, while connected, waits (up to 2 s) until the server confirms, so
    /// messages published after this returns are received.
    async fn subscribe(&self, subject: &str) -> Result<Subscription, ControlError> {
        validate_subject(subject, true)?;
        let subscription = self.open(subject.to_owned()).await?;
        if self.is_connected() {
            // A disconnect meanwhile is fine: the subscription is restored on reconnect.
            let _ = self.flush(SUBSCRIBE_CONFIRM_TIMEOUT).await;
        }
        Ok(subscription)
    }

    async fn request_replies(
        &self,
        subject: &str,
        payload: Bytes,
    ) -> Result<Subscription, ControlError> {
        validate_subject(subject, false)?;
        self.check_publishable(&payload)?;
        let inbox = self.client.new_inbox();
        // No confirmation round trip: the SUB reaches the server before the PUB on the same
        // connection.
        let replies = self.open(inbox.clone()).await?;
        self.client
            .publish_with_reply(subject.to_owned(), inbox, payload)
            .await
            .map_err(transport)?;
        Ok(replies)
    }

    /// Through the stream when there is one: waits until it stored the message.
    async fn publish_durable(&self, subject: &str, payload: Bytes) -> Result<(), ControlError> {
        let Some(durable) = &self.durable else {
            return self.publish(subject, payload).await;
        };
        validate_subject(subject, false)?;
        self.check_publishable(&payload)?;
        let ack = durable
            .context
            .publish(subject.to_owned(), payload)
            .await
            .map_err(transport)?;
        tokio::time::timeout(DURABLE_ACK_TIMEOUT, ack)
            .await
            .map_err(|_| ControlError::Timeout("jetstream ack"))?
            .map(drop)
            .map_err(transport)
    }

    /// Through the stream when there is one: an ordered consumer from now on.
    async fn subscribe_durable(&self, subject: &str) -> Result<Subscription, ControlError> {
        match &self.durable {
            Some(durable) => {
                validate_subject(subject, true)?;
                durable.subscribe(subject).await
            }
            None => self.subscribe(subject).await,
        }
    }

    fn is_durable(&self) -> bool {
        self.durable.is_some()
    }

    fn max_payload(&self) -> usize {
        NatsBus::max_payload(self)
    }

    fn connection_state(&self) -> watch::Receiver<ConnectionState> {
        self.state.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        let servers = |url: &str| NatsSettings::new(url, "t").servers().map(|s| s.len());
        assert_eq!(servers("nats://127.0.0.1:4222").ok(), Some(1));
        assert_eq!(servers("127.0.0.1:5000").ok(), Some(1));
        assert_eq!(servers("tls://a:1, nats://b:2").ok(), Some(2));
        assert!(servers("http://x:1").is_err());
        assert!(servers("ws://x:1").is_err());
        let with_password = servers("nats://u:p@x:1").expect_err("credentials");
        assert!(
            with_password.to_string().contains("in a file"),
            "{with_password}"
        );
        assert!(servers("").is_err());
    }

    #[test]
    fn reconnects_back_off_from_100ms_to_5s() {
        assert_eq!(reconnect_delay(0), RECONNECT_FIRST);
        assert_eq!(reconnect_delay(1), RECONNECT_FIRST);
        assert_eq!(reconnect_delay(2), RECONNECT_FIRST * 2);
        assert_eq!(reconnect_delay(7), RECONNECT_MAX);
        assert_eq!(reconnect_delay(usize::MAX), RECONNECT_MAX);
    }
}

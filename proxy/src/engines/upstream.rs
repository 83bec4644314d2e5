//! The upstream side, shared by every instance: our HTTP/1.1 connection pool for plaintext
//! HTTP/1.1 engines, and one pingora connector with its keep-alive pool for h2c and
//! `https://` engines.

use std::time::Duration;

use bytes::Bytes;
use kvmesh_h1::client::ConnectionPool;
use pingora_core::connectors::ConnectorOptions;
use pingora_core::connectors::http::Connector;
use pingora_core::protocols::http::client::HttpSession;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::ErrorType;
use pingora_http::RequestHeader;

use crate::engines::upstream_session::UpstreamSession;
use crate::metrics::failure::FailureKind;
use crate::openai::headers::EngineHead;

/// What an [`Upstream`] is built from: two equal settings give interchangeable connectors,
/// so a reload that keeps them keeps the pooled connections too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UpstreamSettings {
    /// Idle connections pooled in all (one shared LRU).
    capacity: usize,
    /// Idle HTTP/1.1 connections pooled per engine.
    per_peer: usize,
    /// How long an idle pooled connection is kept.
    pool_idle_timeout: Duration,
    /// CA bundle for `https://` engines (`None`: the system's roots).
    ca_file: Option<String>,
    /// The bundle's bytes when the settings were taken, so a bundle rewritten in place
    /// counts as a change.
    ca_pem: Option<Vec<u8>>,
}

impl UpstreamSettings {
    /// Up to `pool_size` idle connections per instance (one shared LRU of
    /// `pool_size × instances`); `https://` engines are checked against the CAs in
    /// `ca_file` (checked beforehand; `None`: the system's roots).
    pub(crate) fn new(
        pool_size: usize,
        instances: usize,
        pool_idle_timeout: Duration,
        ca_file: Option<String>,
    ) -> Self {
        let ca_pem = ca_file.as_ref().and_then(|path| std::fs::read(path).ok());
        Self {
            capacity: pool_size.saturating_mul(instances.max(1)),
            per_peer: pool_size,
            pool_idle_timeout,
            ca_file,
            ca_pem,
        }
    }
}

/// Connections to engines.
pub(crate) struct Upstream {
    connector: Connector,
    h1: ConnectionPool,
    settings: UpstreamSettings,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// A connector with `settings`.
    pub(crate) fn new(settings: UpstreamSettings) -> Self {
        let mut options = ConnectorOptions::new(settings.capacity);
        options.ca_file.clone_from(&settings.ca_file);
        Self {
            connector: Connector::new(Some(options)),
            h1: ConnectionPool::new(settings.per_peer, settings.pool_idle_timeout),
            settings,
        }
    }

    /// The settings this connector was built from.
    pub(crate) fn settings(&self) -> &UpstreamSettings {
        &self.settings
    }

    /// A session to `peer`: pooled when one is idle, else a new connection.
    /// The flag says whether it was reused.
    ///
    /// Pingora's connect future (TCP and TLS handshakes inline) is about 8 KiB; it is boxed so
    /// that it lives only while connecting instead of enlarging, for the whole stream, the
    /// future of every request that awaits it.
    pub(crate) async fn session(
        &self,
        peer: &HttpPeer,
    ) -> pingora_error::Result<(HttpSession, bool)> {
        Box::pin(self.connector.get_http_session(peer)).await
    }

    /// The pool of plaintext HTTP/1.1 engine connections.
    pub(crate) fn h1(&self) -> &ConnectionPool {
        &self.h1
    }

    /// Returns a finished session to its pool (closed if it cannot be reused).
    ///
    /// Pingora's release is boxed for the same reason as [`Upstream::session`]: its future
    /// holds the session by value, twice.
    pub(crate) async fn release(&self, session: UpstreamSession, peer: &HttpPeer) {
        match session {
            UpstreamSession::H1(exchange) => exchange.release(&self.h1),
            UpstreamSession::Pingora(session) => {
                Box::pin(self.connector.release_http_session(
                    *session,
                    peer,
                    Some(self.settings.pool_idle_timeout),
                ))
                .await;
            }
        }
    }
}

/// `head` as pingora's client writes it (h2c and `https://` engines).
pub(crate) fn pingora_request(head: &EngineHead) -> pingora_error::Result<RequestHeader> {
    let mut request = RequestHeader::build(
        head.method.clone(),
        head.path.as_bytes(),
        Some(head.headers.len()),
    )?;
    for (name, value) in &head.headers {
        request.append_header(name.clone(), value.clone())?;
    }
    Ok(request)
}

/// Sends `request` and `body` on `session` and reads the response head (informational ones
/// skipped). `Err`: the failure's kind, and what pingora said.
pub(crate) async fn pingora_exchange(
    session: &mut HttpSession,
    request: RequestHeader,
    body: &Bytes,
) -> Result<(), (FailureKind, String)> {
    pingora_send(session, request, body).await?;
    pingora_head(session).await
}

/// A request ready for pingora's client: its head, and a session to the engine.
pub(crate) struct Outgoing {
    /// The head.
    pub(crate) request: RequestHeader,
    /// The session.
    pub(crate) session: HttpSession,
    /// Taken from the pool (not a new connection).
    pub(crate) reused: bool,
}

/// A request sent whose answer is read later ([`SentLeg::answer`]): SGLang's prefill leg,
/// answered only once its decode leg has joined the bootstrap room.
pub(crate) struct SentLeg(Box<HttpSession>);

impl SentLeg {
    /// The request sent on `session`.
    pub(crate) fn new(session: HttpSession) -> Self {
        Self(Box::new(session))
    }

    /// Reads the answer's head; its body is then read from the session returned.
    pub(crate) async fn answer(mut self) -> Result<UpstreamSession, (FailureKind, String)> {
        pingora_head(&mut self.0).await?;
        Ok(UpstreamSession::Pingora(self.0))
    }
}

/// Sends `request` and `body` on `session`, whose answer is read later ([`pingora_head`]).
pub(crate) async fn pingora_send(
    session: &mut HttpSession,
    request: RequestHeader,
    body: &Bytes,
) -> Result<(), (FailureKind, String)> {
    let send = async {
        session.write_request_header(Box::new(request)).await?;
        if !body.is_empty() {
            session.write_request_body(body.clone(), true).await?;
        }
        session.finish_request_body().await
    };
    send.await.map_err(pingora_failure)
}

/// Reads the response head on `session` (informational ones skipped).
pub(crate) async fn pingora_head(session: &mut HttpSession) -> Result<(), (FailureKind, String)> {
    loop {
        session
            .read_response_header()
            .await
            .map_err(pingora_failure)?;
        let informational = session
            .response_header()
            .is_some_and(|header| header.status.is_informational());
        if !informational {
            return Ok(());
        }
    }
}

/// The kind of a failure pingora reports, and what it said.
pub(crate) fn pingora_failure(error: Box<pingora_error::Error>) -> (FailureKind, String) {
    let kind = match error.etype() {
        ErrorType::ConnectTimedout
        | ErrorType::ConnectRefused
        | ErrorType::ConnectNoRoute
        | ErrorType::ConnectError => FailureKind::Connect,
        ErrorType::ReadTimedout | ErrorType::WriteTimedout => FailureKind::Timeout,
        _ => FailureKind::Reset,
    };
    (kind, error.to_string())
}

//! The upstream side: one pingora connector with a keep-alive pool, shared
//! by every instance, and the per-request timeouts.

use std::time::Duration;

use pingora_core::connectors::ConnectorOptions;
use pingora_core::connectors::http::Connector;
use pingora_core::protocols::http::client::HttpSession;
use pingora_core::upstreams::peer::HttpPeer;

/// Connections to engines.
pub(crate) struct Upstream {
    connector: Connector,
    pool_idle_timeout: Duration,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("pool_idle_timeout", &self.pool_idle_timeout)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// A connector keeping up to `pool_size` idle connections per instance
    /// (one shared LRU of `pool_size × instances`); `https://` engines are
    /// checked against the CAs in `ca_file` (checked beforehand; `None`: the
    /// system's roots).
    pub(crate) fn new(
        pool_size: usize,
        instances: usize,
        pool_idle_timeout: Duration,
        ca_file: Option<String>,
    ) -> Self {
        let mut options = ConnectorOptions::new(pool_size.saturating_mul(instances.max(1)));
        options.ca_file = ca_file;
        Self {
            connector: Connector::new(Some(options)),
            pool_idle_timeout,
        }
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

    /// Returns a finished session to the pool (closed if it cannot be reused).
    ///
    /// Boxed for the same reason as [`Upstream::session`]: the release future holds the session
    /// by value, twice.
    pub(crate) async fn release(&self, session: HttpSession, peer: &HttpPeer) {
        Box::pin(
            self.connector
                .release_http_session(session, peer, Some(self.pool_idle_timeout)),
        )
        .await;
    }
}

//! A data listener's TLS: its terminator and metric handles, shared by the
//! accept loop and the file watcher.

use std::sync::Arc;
use std::time::Duration;

use pingora_core::protocols::Stream;
use tokio::net::TcpStream;
use tokio::time::timeout;

use crate::edge::edge_metrics::TlsMetrics;
use crate::edge::tls::TlsTerminator;

/// TLS on one data listener.
#[derive(Debug)]
pub(crate) struct ListenerTls {
    /// The listener's name (logs and metric labels).
    pub(crate) listener: String,
    /// The current configuration.
    pub(crate) terminator: Arc<TlsTerminator>,
    /// Handshake and reload counters.
    pub(crate) metrics: TlsMetrics,
}

impl ListenerTls {
    /// The handshake on `tcp`, within `limit`; failures are counted and logged
    /// at debug level (scanners and wrong-CA clients are routine).
    pub(crate) async fn accept(&self, tcp: TcpStream, limit: Duration) -> Option<Stream> {
        match timeout(limit, self.terminator.handshake(tcp)).await {
            Ok(Ok(stream)) => Some(stream),
            Ok(Err(error)) => {
                self.metrics.handshake_error.inc();
                tracing::debug!(listener = %self.listener, %error, "TLS handshake failed");
                None
            }
            Err(_) => {
                self.metrics.handshake_timeout.inc();
                tracing::debug!(listener = %self.listener, "TLS handshake timed out");
                None
            }
        }
    }
}

//! One TLS listener's configuration, swapped whole when its files change or a
//! reload changes its settings. Each handshake takes the configuration current
//! when it starts, so open connections keep the certificate they agreed on and
//! new handshakes get the new one.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;
use kvmesh_config::ListenerTlsConfig;
use pingora_core::listeners::tls::Acceptor;
use pingora_core::protocols::Stream;
use pingora_core::protocols::l4::stream::Stream as L4Stream;
use prometheus::IntGauge;
use rustls::ServerConfig;
use tokio::net::TcpStream;

use crate::edge::tls::server_config::server_config;
use crate::edge::tls::{FileStamps, TlsError};

/// A listener's TLS settings with their files read and checked.
#[derive(Debug, Clone)]
pub(crate) struct TlsSettings {
    settings: ListenerTlsConfig,
    field: String,
    stamps: FileStamps,
    config: Arc<ServerConfig>,
    /// When the certificate expires, in Unix seconds.
    expires: i64,
}

impl TlsSettings {
    /// Reads and checks the files `tls` names; `field` (`listeners[i].tls`) names
    /// the section in errors.
    pub(crate) fn load(tls: &ListenerTlsConfig, field: &str) -> Result<Self, TlsError> {
        // Stamped before reading, so a change during the read is seen by the next poll.
        let stamps = FileStamps::of(files(tls));
        let (config, expires) = server_config(tls, field)?;
        Ok(Self {
            settings: tls.clone(),
            field: field.to_string(),
            stamps,
            config,
            expires,
        })
    }
}

/// The files a TLS section names.
fn files(tls: &ListenerTlsConfig) -> impl Iterator<Item = &Path> {
    [
        Some(tls.cert.as_path()),
        Some(tls.key.as_path()),
        tls.client_ca.as_deref(),
    ]
    .into_iter()
    .flatten()
}

/// What a poll of the files found.
#[derive(Debug)]
pub(crate) enum Refresh {
    /// Nothing changed (or the change was already tried).
    Unchanged,
    /// New files were loaded; new handshakes use them.
    Reloaded,
    /// The files changed but cannot be used; the previous ones stay in use.
    Rejected(TlsError),
}

/// A TLS data listener's current configuration.
#[derive(Debug)]
pub(crate) struct TlsTerminator {
    current: ArcSwap<TlsSettings>,
    /// Stamps of the last attempt, so a broken file is reported once per change.
    attempted: Mutex<FileStamps>,
    /// `kvmesh_tls_certificate_expiry_timestamp_seconds{listener}`: the current certificate's.
    expiry: IntGauge,
}

impl TlsTerminator {
    /// A terminator serving `settings`, showing when its certificate expires on `expiry`.
    pub(crate) fn new(settings: TlsSettings, expiry: IntGauge) -> Self {
        expiry.set(settings.expires);
        Self {
            attempted: Mutex::new(settings.stamps.clone()),
            current: ArcSwap::from_pointee(settings),
            expiry,
        }
    }

    /// Installs settings loaded by a config reload.
    pub(crate) fn install(&self, settings: TlsSettings) {
        let mut attempted = self
            .attempted
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *attempted = settings.stamps.clone();
        self.store(settings);
    }

    /// Serves `settings` from the next handshake on.
    fn store(&self, settings: TlsSettings) {
        self.expiry.set(settings.expires);
        self.current.store(Arc::new(settings));
    }

    /// Reloads the files when they changed since they were last read.
    pub(crate) fn refresh(&self) -> Refresh {
        let mut attempted = self
            .attempted
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let current = self.current.load_full();
        let now = current.stamps.now();
        if now == *attempted {
            return Refresh::Unchanged;
        }
        *attempted = now;
        match TlsSettings::load(&current.settings, &current.field) {
            Ok(settings) => {
                *attempted = settings.stamps.clone();
                self.store(settings);
                Refresh::Reloaded
            }
            Err(error) => Refresh::Rejected(error),
        }
    }

    /// Runs the server handshake on `tcp` with the current configuration.
    pub(crate) async fn handshake(&self, tcp: TcpStream) -> pingora_error::Result<Stream> {
        let config = Arc::clone(&self.current.load().config);
        let acceptor = Acceptor::from_server_config(config);
        let stream = acceptor.tls_handshake(L4Stream::from(tcp)).await?;
        Ok(Box::new(stream))
    }
}

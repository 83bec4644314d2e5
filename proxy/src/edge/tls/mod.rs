//! TLS: termination on data listeners (rustls with the ring provider, ALPN h2
//! and http/1.1, optional client certificates), certificate rotation without
//! dropping connections, and the CA bundle for `https://` engines.

mod error;
mod files;
mod listener;
mod pem;
mod server_config;
pub(crate) mod terminator;
mod upstream;

pub use error::TlsError;
pub(crate) use files::FileStamps;
pub(crate) use listener::ListenerTls;
pub(crate) use terminator::{TlsSettings, TlsTerminator};
pub(crate) use upstream::upstream_ca_file;

/// Reads every TLS file `config` names the way the proxy does (certificate
/// chains, keys and whether they match, CA bundles), so `--check-config` finds
/// what plain validation cannot.
pub fn check_config_files(config: &kvmesh_config::Config) -> Result<(), TlsError> {
    for (i, listener) in config.listeners.iter().enumerate() {
        if let Some(tls) = &listener.tls {
            TlsSettings::load(tls, &format!("listeners[{i}].tls"))?;
        }
    }
    upstream_ca_file(&config.upstream.tls).map(|_| ())
}

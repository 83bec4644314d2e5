//! Building a listener's rustls server configuration from its files.

use std::sync::Arc;

use kvmesh_config::ListenerTlsConfig;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;

use crate::edge::tls::{TlsError, pem};

/// ALPN protocols offered to clients, preferred first.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// The ring provider, shared by every configuration.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads `tls`'s files and builds the server configuration, with when its certificate
/// expires (Unix seconds); `field` is the section's path (`listeners[i].tls`) for errors.
pub(crate) fn server_config(
    tls: &ListenerTlsConfig,
    field: &str,
) -> Result<(Arc<ServerConfig>, i64), TlsError> {
    let cert_field = format!("{field}.cert");
    let key_field = format!("{field}.key");
    let chain = pem::certificates(&tls.cert, &cert_field)?;
    let expires = pem::not_after(&chain[0], &tls.cert, &cert_field)?;
    let key = pem::private_key(&tls.key, &key_field)?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|error| TlsError::new(&cert_field, &tls.cert, error.to_string()))?;
    let builder = match &tls.client_ca {
        Some(ca) => {
            let ca_field = format!("{field}.client_ca");
            let roots = pem::roots(ca, &ca_field)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if tls.require_client_cert {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            let verifier = verifier
                .build()
                .map_err(|error| TlsError::new(&ca_field, ca, error.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|error| {
        TlsError::new(
            &key_field,
            &tls.key,
            format!(
                "does not go with the certificate in {}: {error}",
                tls.cert.display()
            ),
        )
    })?;
    config.alpn_protocols = ALPN.iter().map(|protocol| protocol.to_vec()).collect();
    Ok((Arc::new(config), expires))
}

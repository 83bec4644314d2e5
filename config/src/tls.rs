//! TLS settings: termination on a data listener (with optional client
//! certificates) and the CA bundle that checks `https://` engines.
//!
//! Validation reads the named files and checks that each holds a PEM block of
//! the right kind, so `--check-config` and a reload catch a wrong path early;
//! the proxy parses them fully when it builds its TLS configuration.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::FieldPath;
use crate::violation::{Checked, fail};

/// TLS termination on one data listener (ALPN `h2` and `http/1.1`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTlsConfig {
    /// PEM file with the certificate chain, leaf first. Re-read when it changes.
    pub cert: PathBuf,
    /// PEM file with the private key (PKCS#8, PKCS#1 or SEC1). Re-read when it changes.
    pub key: PathBuf,
    /// PEM bundle of the CAs whose client certificates are accepted (mTLS). Without
    /// it, clients are not asked for a certificate.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
    /// Refuse a client that presents no certificate signed by `client_ca`
    /// (needs `client_ca`); when false, a certificate is verified if presented.
    #[serde(default)]
    pub require_client_cert: bool,
}

/// TLS towards engines: used for backends whose URL is `https://host:port`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamTlsConfig {
    /// PEM bundle of the CAs that sign the engines' certificates; `null` (the
    /// default): the system's trusted roots.
    pub ca: Option<PathBuf>,
}

/// PEM labels of a certificate.
pub(crate) const CERTIFICATE: &[&str] = &["CERTIFICATE"];
/// PEM labels of a private key.
pub(crate) const PRIVATE_KEY: &[&str] = &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"];

/// Checks one listener's TLS section; `path` is `listeners[i].tls`.
pub(crate) fn check_listener_tls(tls: &ListenerTlsConfig, path: &FieldPath) -> Checked {
    pem_file(&tls.cert, CERTIFICATE, "certificate", path.key("cert"))?;
    pem_file(&tls.key, PRIVATE_KEY, "private key", path.key("key"))?;
    if let Some(ca) = &tls.client_ca {
        pem_file(ca, CERTIFICATE, "CA certificate", path.key("client_ca"))?;
    } else if tls.require_client_cert {
        return fail(
            path.key("require_client_cert"),
            "needs client_ca (the CAs that sign accepted client certificates)",
        );
    }
    Ok(())
}

/// Checks `upstream.tls`; `path` is `upstream.tls`.
pub(crate) fn check_upstream_tls(tls: &UpstreamTlsConfig, path: &FieldPath) -> Checked {
    match &tls.ca {
        Some(ca) => pem_file(ca, CERTIFICATE, "CA certificate", path.key("ca")),
        None => Ok(()),
    }
}

/// The file at `file` is readable and holds a PEM block labelled one of `labels`.
pub(crate) fn pem_file(file: &Path, labels: &[&str], what: &str, field: FieldPath) -> Checked {
    if file.as_os_str().is_empty() {
        return fail(field, "must not be empty");
    }
    let text = match std::fs::read(file) {
        Ok(bytes) => bytes,
        Err(error) => {
            return fail(field, format!("cannot read {}: {error}", file.display()));
        }
    };
    let text = String::from_utf8_lossy(&text);
    let found = labels
        .iter()
        .any(|label| text.contains(&format!("-----BEGIN {label}-----")));
    if !found {
        return fail(field, format!("{} holds no PEM {what}", file.display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvmesh-config-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn files_must_hold_the_right_pem_block() {
        let cert = temp_file(
            "c.pem",
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        );
        let key = temp_file(
            "k.pem",
            "-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n",
        );
        let root = FieldPath::root().key("tls");
        let good = ListenerTlsConfig {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: None,
            require_client_cert: false,
        };
        assert!(check_listener_tls(&good, &root).is_ok());

        let swapped = ListenerTlsConfig {
            cert: key.clone(),
            key: cert.clone(),
            ..good.clone()
        };
        let violation = check_listener_tls(&swapped, &root).unwrap_err();
        assert_eq!(violation.path.to_string(), "tls.cert");
        assert!(
            violation.message.contains("no PEM certificate"),
            "{violation:?}"
        );
        assert!(violation.message.contains("k.pem"), "{violation:?}");

        let missing = ListenerTlsConfig {
            key: PathBuf::from("/nonexistent/kvmesh/key.pem"),
            ..good.clone()
        };
        let violation = check_listener_tls(&missing, &root).unwrap_err();
        assert_eq!(violation.path.to_string(), "tls.key");
        assert!(violation.message.contains("/nonexistent/kvmesh/key.pem"));

        let no_ca = ListenerTlsConfig {
            require_client_cert: true,
            ..good
        };
        let violation = check_listener_tls(&no_ca, &root).unwrap_err();
        assert_eq!(violation.path.to_string(), "tls.require_client_cert");

        let upstream = UpstreamTlsConfig { ca: Some(key) };
        let violation = check_upstream_tls(&upstream, &FieldPath::root().key("u")).unwrap_err();
        assert_eq!(violation.path.to_string(), "u.ca");
        assert!(check_upstream_tls(&UpstreamTlsConfig { ca: Some(cert) }, &root).is_ok());
    }
}

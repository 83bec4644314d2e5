//! Reading PEM certificates, keys and CA bundles, with errors that name the
//! config field and the file.

use std::path::Path;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::edge::tls::TlsError;

/// Reads `file` whole.
fn read(file: &Path, field: &str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(file).map_err(|error| TlsError::new(field, file, format!("cannot read: {error}")))
}

/// The certificate chain in `file` (leaf first).
pub(crate) fn certificates(
    file: &Path,
    field: &str,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(file, field)?;
    let chain = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| TlsError::new(field, file, format!("invalid PEM: {error}")))?;
    if chain.is_empty() {
        return Err(TlsError::new(field, file, "holds no certificate"));
    }
    Ok(chain)
}

/// When `certificate` (read from `file`) expires: its `notAfter`, in Unix seconds.
pub(crate) fn not_after(
    certificate: &CertificateDer<'_>,
    file: &Path,
    field: &str,
) -> Result<i64, TlsError> {
    x509_parser::parse_x509_certificate(certificate)
        .map(|(_, parsed)| parsed.validity().not_after.timestamp())
        .map_err(|error| {
            TlsError::new(
                field,
                file,
                format!("not a readable X.509 certificate: {error}"),
            )
        })
}

/// The first private key in `file` (PKCS#8, PKCS#1 or SEC1).
pub(crate) fn private_key(file: &Path, field: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(file, field)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|error| {
        TlsError::new(field, file, format!("holds no usable private key: {error}"))
    })
}

/// The CA certificates in `file` as a trust store.
pub(crate) fn roots(file: &Path, field: &str) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for certificate in certificates(file, field)? {
        store.add(certificate).map_err(|error| {
            TlsError::new(field, file, format!("not a usable CA certificate: {error}"))
        })?;
    }
    Ok(store)
}

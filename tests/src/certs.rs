//! Certificates for TLS tests, made on the spot with rcgen: a CA, a server
//! certificate for `localhost` and `127.0.0.1` signed by it, a client
//! certificate signed by it, and an unrelated CA (the "wrong CA").

use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// PEM files of a test PKI, in one directory.
pub struct TestCerts {
    /// The CA certificate (trust anchor for clients and for client certificates).
    pub ca: PathBuf,
    /// The server certificate chain.
    pub server_cert: PathBuf,
    /// The server's private key.
    pub server_key: PathBuf,
    /// A client certificate signed by the CA (mTLS).
    pub client_cert: PathBuf,
    /// The client's private key.
    pub client_key: PathBuf,
    /// A CA that signed nothing here.
    pub other_ca: PathBuf,
    ca_params: CertificateParams,
    ca_key: KeyPair,
}

impl TestCerts {
    /// Generates the PKI and writes its files into `dir`.
    pub fn generate(dir: &Path) -> anyhow::Result<Self> {
        let (ca_params, ca_key, ca_pem) = ca("kvmesh test CA")?;
        let (_, _, other_pem) = ca("kvmesh unrelated CA")?;
        let certs = Self {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
            other_ca: dir.join("other-ca.pem"),
            ca_params,
            ca_key,
        };
        write(&certs.ca, &ca_pem)?;
        write(&certs.other_ca, &other_pem)?;
        certs.rotate_server()?;
        let (client_pem, client_key) = certs.leaf("kvmesh test client", &[], false)?;
        write(&certs.client_cert, &client_pem)?;
        write(&certs.client_key, &client_key)?;
        Ok(certs)
    }

    /// Writes a new server certificate and key (signed by the same CA) over the
    /// old files, each replaced atomically; returns the new certificate's PEM.
    pub fn rotate_server(&self) -> anyhow::Result<String> {
        let (cert, key) = self.leaf("localhost", &["localhost", "127.0.0.1"], true)?;
        write(&self.server_key, &key)?;
        write(&self.server_cert, &cert)?;
        Ok(cert)
    }

    /// A leaf certificate and key signed by the CA.
    fn leaf(&self, name: &str, sans: &[&str], server: bool) -> anyhow::Result<(String, String)> {
        let key = KeyPair::generate()?;
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![if server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        let issuer = Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params.signed_by(&key, &issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

/// A self-signed CA: its parameters, key and certificate PEM.
fn ca(name: &str) -> anyhow::Result<(CertificateParams, KeyPair, String)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key)?;
    Ok((params, key, cert.pem()))
}

/// Writes `text` to `path` through a temporary file and a rename.
fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    let temporary = path.with_extension("tmp");
    std::fs::write(&temporary, text).with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("renaming to {}", path.display()))
}

//! TLS and credentials of the proxy's control-plane clients: `discovery.tls`,
//! `discovery.auth` (etcd) and `events.tls`, `events.auth` (NATS). Secrets are named by file,
//! never written in the config (docs/security.md).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::FieldPath;
use crate::tls::{CERTIFICATE, PRIVATE_KEY, pem_file};
use crate::violation::{Checked, fail};

/// TLS towards etcd or NATS (`discovery.tls`, `events.tls`). Present: TLS is required
/// (etcd endpoints are `https://`); absent: plaintext.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlTlsConfig {
    /// PEM bundle of the CAs that sign the servers' certificates. Required for etcd; for
    /// NATS, `null` means the system's trusted roots.
    pub ca: Option<PathBuf>,
    /// PEM client certificate (chain) for mutual TLS; needs `key`.
    pub cert: Option<PathBuf>,
    /// PEM private key of `cert`.
    pub key: Option<PathBuf>,
}

/// etcd's user / password auth (`discovery.auth`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdAuthConfig {
    /// The etcd user.
    pub user: String,
    /// File holding the user's password.
    pub password_file: PathBuf,
}

/// NATS credentials (`events.auth`): exactly one of a token, a user and password, an NKey
/// seed or a creds file.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsAuthConfig {
    /// File holding a token (nats-server `authorization { token }`).
    pub token_file: Option<PathBuf>,
    /// User name; needs `password_file`.
    pub user: Option<String>,
    /// File holding the user's password.
    pub password_file: Option<PathBuf>,
    /// File holding an NKey seed (`SU…`).
    pub nkey_seed_file: Option<PathBuf>,
    /// A `.creds` file (user JWT and NKey seed, as `nsc` writes it).
    pub creds_file: Option<PathBuf>,
}

impl NatsAuthConfig {
    /// How many kinds of credentials are set.
    fn kinds(&self) -> usize {
        [
            self.token_file.is_some(),
            self.user.is_some() || self.password_file.is_some(),
            self.nkey_seed_file.is_some(),
            self.creds_file.is_some(),
        ]
        .into_iter()
        .filter(|set| *set)
        .count()
    }
}

/// A secret file must be readable and not empty (its content is never echoed).
fn secret_file(file: &Path, field: FieldPath) -> Checked {
    if file.as_os_str().is_empty() {
        return fail(field, "must not be empty");
    }
    match std::fs::read_to_string(file) {
        Ok(text) if text.trim().is_empty() => fail(field, format!("{} is empty", file.display())),
        Ok(_) => Ok(()),
        Err(error) => fail(field, format!("cannot read {}: {error}", file.display())),
    }
}

/// Checks a `tls` block of `discovery` or `events`; `path` points at it.
pub(crate) fn check_control_tls(tls: &ControlTlsConfig, path: &FieldPath) -> Checked {
    if let Some(ca) = &tls.ca {
        pem_file(ca, CERTIFICATE, "CA certificate", path.key("ca"))?;
    }
    match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            pem_file(cert, CERTIFICATE, "certificate", path.key("cert"))?;
            pem_file(key, PRIVATE_KEY, "private key", path.key("key"))
        }
        (None, None) => Ok(()),
        (Some(_), None) => fail(path.key("key"), "cert needs key"),
        (None, Some(_)) => fail(path.key("cert"), "key needs cert"),
    }
}

/// Checks `discovery.auth`.
pub(crate) fn check_etcd_auth(auth: &EtcdAuthConfig, path: &FieldPath) -> Checked {
    if auth.user.trim().is_empty() {
        return fail(path.key("user"), "must not be empty");
    }
    secret_file(&auth.password_file, path.key("password_file"))
}

/// Checks `events.auth`.
pub(crate) fn check_nats_auth(auth: &NatsAuthConfig, path: &FieldPath) -> Checked {
    if auth.kinds() > 1 {
        return fail(
            path.clone(),
            "set one of token_file, user + password_file, nkey_seed_file, creds_file",
        );
    }
    match (&auth.user, &auth.password_file) {
        (Some(user), Some(file)) => {
            if user.trim().is_empty() {
                return fail(path.key("user"), "must not be empty");
            }
            secret_file(file, path.key("password_file"))?;
        }
        (Some(_), None) => return fail(path.key("password_file"), "user needs password_file"),
        (None, Some(_)) => return fail(path.key("user"), "password_file needs user"),
        (None, None) => {}
    }
    if let Some(file) = &auth.token_file {
        secret_file(file, path.key("token_file"))?;
    }
    if let Some(file) = &auth.nkey_seed_file {
        secret_file(file, path.key("nkey_seed_file"))?;
    }
    if let Some(file) = &auth.creds_file {
        secret_file(file, path.key("creds_file"))?;
    }
    Ok(())
}

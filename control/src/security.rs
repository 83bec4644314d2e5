//! How the control-plane clients prove who they talk to and who they are: TLS files (a CA
//! to verify the server, a client certificate and key for mutual TLS) and credentials, with
//! every secret read from a file (never from YAML or a flag value, which end up in process
//! listings and config dumps).

use std::path::{Path, PathBuf};

use crate::error::ControlError;

/// TLS towards a control-plane server. With no field set, TLS is still used (a `tls://` or
/// `https://` URL) and the server is verified against the system's roots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM bundle of the CA(s) that signed the server's certificate.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate (chain) for mutual TLS; needs `key_file`.
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<PathBuf>,
}

impl TlsFiles {
    /// The client certificate and key, when both are set; an error when only one is.
    pub fn client_identity(&self) -> Result<Option<(&Path, &Path)>, ControlError> {
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Ok(Some((cert, key))),
            (None, None) => Ok(None),
            _ => Err(ControlError::Config(
                "a TLS client certificate needs both cert_file and key_file".to_owned(),
            )),
        }
    }
}

/// How a NATS client authenticates (nats-server's `authorization` / `accounts` blocks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// A token, read from a file.
    Token {
        /// File holding the token (surrounding whitespace is ignored).
        token_file: PathBuf,
    },
    /// A user and a password read from a file.
    UserPassword {
        /// The user name.
        user: String,
        /// File holding the password.
        password_file: PathBuf,
    },
    /// An NKey seed (`SU...`), read from a file.
    Nkey {
        /// File holding the seed.
        seed_file: PathBuf,
    },
    /// A `.creds` file (a user JWT and its NKey seed), as `nsc` writes it.
    Credentials {
        /// The creds file.
        creds_file: PathBuf,
    },
}

impl NatsAuth {
    /// The first kind of credentials given, in the order token, user and password, NKey
    /// seed, creds file (settings that allow only one check that before).
    pub fn first_of(
        token_file: Option<PathBuf>,
        user_password: Option<(String, PathBuf)>,
        seed_file: Option<PathBuf>,
        creds_file: Option<PathBuf>,
    ) -> Self {
        if let Some(token_file) = token_file {
            Self::Token { token_file }
        } else if let Some((user, password_file)) = user_password {
            Self::UserPassword {
                user,
                password_file,
            }
        } else if let Some(seed_file) = seed_file {
            Self::Nkey { seed_file }
        } else if let Some(creds_file) = creds_file {
            Self::Credentials { creds_file }
        } else {
            Self::None
        }
    }
}

/// How an etcd client authenticates: etcd's user / password auth (`etcdctl auth enable`).
/// Client certificates are in [`TlsFiles`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdAuth {
    /// The etcd user.
    pub user: String,
    /// File holding the password.
    pub password_file: PathBuf,
}

/// Reads a secret from `path`, without surrounding whitespace; a clear error naming the file
/// (but never its content) when it cannot be read or is empty.
pub fn read_secret(path: &Path, what: &str) -> Result<String, ControlError> {
    let text = std::fs::read_to_string(path).map_err(|error| {
        ControlError::Config(format!(
            "cannot read the {what} file {}: {error}",
            path.display()
        ))
    })?;
    let secret = text.trim();
    if secret.is_empty() {
        return Err(ControlError::Config(format!(
            "the {what} file {} is empty",
            path.display()
        )));
    }
    Ok(secret.to_owned())
}

/// Reads a PEM file named in TLS settings, with a clear error naming it.
#[cfg(feature = "transports")]
pub(crate) fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>, ControlError> {
    std::fs::read(path).map_err(|error| {
        ControlError::Config(format!(
            "cannot read the {what} {}: {error}",
            path.display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_trimmed_and_empty_or_missing_files_are_named() {
        let dir = std::env::temp_dir().join(format!("kvmesh-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("token");
        std::fs::write(&file, "  s3cret\n").expect("write");
        assert_eq!(read_secret(&file, "token").expect("read"), "s3cret");
        std::fs::write(&file, "\n").expect("write");
        let empty = read_secret(&file, "token").expect_err("empty");
        assert!(empty.to_string().contains("is empty"), "{empty}");
        let missing = read_secret(&dir.join("nope"), "password").expect_err("missing");
        assert!(missing.to_string().contains("password file"), "{missing}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_client_certificate_needs_its_key() {
        let half = TlsFiles {
            cert_file: Some("c.pem".into()),
            ..TlsFiles::default()
        };
        assert!(half.client_identity().is_err());
        assert_eq!(TlsFiles::default().client_identity().expect("none"), None);
    }
}

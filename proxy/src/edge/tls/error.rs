//! Errors in the TLS part of the config: they name the field and the file.

use std::fmt;

/// A TLS setting whose file could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsError {
    /// The config field, e.g. `listeners[0].tls.cert`.
    pub field: String,
    /// The file it names.
    pub file: String,
    /// What is wrong with it.
    pub reason: String,
}

impl TlsError {
    /// An error of `field`, which names `file`.
    pub(crate) fn new(field: &str, file: &std::path::Path, reason: impl Into<String>) -> Self {
        Self {
            field: field.to_string(),
            file: file.display().to_string(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.field, self.file, self.reason)
    }
}

impl std::error::Error for TlsError {}

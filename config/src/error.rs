//! Config errors that name the file, line, column and field.

use std::fmt;

use crate::FieldPath;

/// A line and column in the config text (both 1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextPosition {
    /// Line, from 1.
    pub line: u64,
    /// Column, from 1.
    pub column: u64,
}

/// Why a config was rejected: unreadable file, invalid YAML, or a value that
/// failed validation.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: cannot read config file: {source}")]
    Read {
        /// The path as given.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The text is not a valid config.
    #[error("{0}")]
    Invalid(Invalid),
}

/// An invalid config: where and what.
///
/// Displays as `config.yaml:12:5: models[0].backends[1].url: invalid URL "x"`;
/// parts that are unknown are left out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// Name of the source (usually the file path).
    pub source_name: String,
    /// Where in the text, when known.
    pub position: Option<TextPosition>,
    /// Which field, when known.
    pub field: Option<FieldPath>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source_name)?;
        if let Some(position) = self.position {
            write!(f, ":{}:{}", position.line, position.column)?;
        }
        f.write_str(": ")?;
        if let Some(field) = self.field.as_ref().filter(|field| !field.is_root()) {
            write!(f, "{field}: ")?;
        }
        f.write_str(&self.message)
    }
}

impl ConfigError {
    /// The details of an invalid config (`None` for read errors).
    pub fn invalid(&self) -> Option<&Invalid> {
        match self {
            Self::Invalid(invalid) => Some(invalid),
            Self::Read { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_leaves_out_unknown_parts() {
        let full = Invalid {
            source_name: "config.yaml".into(),
            position: Some(TextPosition {
                line: 12,
                column: 5,
            }),
            field: Some(FieldPath::root().key("models").index(0).key("name")),
            message: "must not be empty".into(),
        };
        assert_eq!(
            full.to_string(),
            "config.yaml:12:5: models[0].name: must not be empty"
        );
        let bare = Invalid {
            source_name: "config".into(),
            position: None,
            field: None,
            message: "broken".into(),
        };
        assert_eq!(ConfigError::Invalid(bare).to_string(), "config: broken");
    }
}

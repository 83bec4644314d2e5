//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading a model's tokenizer files or preprocessing a request.
///
/// The proxy maps the variants for which [`PreprocessError::is_client_error`] holds to HTTP 400
/// with the error's message (for a template error, the template's own `raise_exception` text).
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// A tokenizer file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is malformed or lacks what is needed.
    #[error("invalid tokenizer config {path}: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// `tokenizer.json` could not be loaded by the `tokenizers` library.
    #[error("cannot load tokenizer {path}: {message}")]
    TokenizerLoad {
        /// The tokenizer file.
        path: PathBuf,
        /// The library's error message.
        message: String,
    },
    /// The model has no chat template, so chat requests cannot be rendered.
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// The chat template does not compile.
    #[error("chat template does not compile: {0}")]
    TemplateCompile(String),
    /// The request body is not a valid chat request (bad JSON, wrong types, invalid tool-call arguments).
    #[error("invalid chat request: {0}")]
    InvalidRequest(String),
    /// The template raised (`raise_exception`) or failed while rendering this request.
    #[error("{0}")]
    Template(String),
    /// The request holds content this crate cannot turn into the engine's exact tokens (images, audio, video).
    #[error("unsupported content: {0}")]
    UnsupportedContent(String),
    /// The tokenizer failed to encode the text.
    #[error("tokenization failed: {0}")]
    Encode(String),
}

impl PreprocessError {
    /// True when the request itself is at fault (answer HTTP 400 with [`ToString::to_string`] as message).
    pub fn is_client_error(&self) -> bool {
        matches!(self, Self::InvalidRequest(_) | Self::Template(_))
    }
}

/// The crate's result type.
pub type Result<T, E = PreprocessError> = std::result::Result<T, E>;

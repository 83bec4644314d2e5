//! Wire shapes: OpenAI / SGLang request bodies and their validation, response bodies, and the
//! Responses API.

pub(crate) mod prompt;
pub(crate) mod requests;
pub(crate) mod responses;
pub(crate) mod responses_api;

/// A request body that parsed but is not acceptable; answered with a 400.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InvalidRequest {
    /// Human-readable reason.
    pub message: String,
    /// The offending field, when there is one.
    pub param: Option<&'static str>,
}

impl InvalidRequest {
    /// An error about field `param`.
    pub(crate) fn field(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            param: Some(param),
        }
    }
}

//! A request whose tensors or parameters cannot be served (INVALID_ARGUMENT).

/// Why a request's inputs, outputs or parameters are malformed; the message names the
/// tensor or parameter at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidInput(pub String);

impl InvalidInput {
    /// An error with `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

//! A request whose tensors or parameters cannot be served (INVALID_ARGUMENT).

/// Why a request's inputs, outputs or parameters are malformed; the message names the
/// tensor or parameter at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InvalidInput(pub(crate) String);

impl InvalidInput {
    /// An error with `message`.
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

//! Why a proxied request stops before the engine's answer reaches the client.

use crate::openai::api_error::ApiError;

/// A request that ends early: with an error the front end answers, or because its client
/// left.
#[derive(Debug)]
pub(crate) enum Stop {
    /// The proxy answers with this error.
    Answer(ApiError),
    /// The client went away.
    ClientGone,
}

impl From<ApiError> for Stop {
    fn from(error: ApiError) -> Self {
        Stop::Answer(error)
    }
}

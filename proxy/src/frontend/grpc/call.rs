//! What a KServe call carries besides its requests: its metadata as the requests need it.

use std::sync::Arc;

use tokio::time::Instant;
use tonic::metadata::AsciiMetadataValue;

/// The call's `authorization` metadata value, if any.
pub(crate) type Credentials = Option<Arc<[u8]>>;

/// What a call carries besides its requests.
#[derive(Debug, Clone, Default)]
pub(crate) struct Call {
    /// The `authorization` metadata (the API key).
    pub(crate) credentials: Credentials,
    /// When the call must end (`grpc-timeout`).
    pub(crate) deadline: Option<Instant>,
    /// The `traceparent` metadata (W3C trace context; read only while tracing).
    pub(crate) traceparent: Option<AsciiMetadataValue>,
    /// The `tracestate` metadata.
    pub(crate) tracestate: Option<AsciiMetadataValue>,
}

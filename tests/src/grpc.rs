//! gRPC clients with deadlines: a channel whose connect is bounded, and stream reads that
//! fail the test instead of hanging when the server goes quiet. No per-call deadline is set
//! on the channel: it would travel as `grpc-timeout` and change what the proxy does.

use std::time::Duration;

use tonic::Streaming;
use tonic::transport::{Channel, Endpoint};

/// How long a connect may take.
pub const CONNECT: Duration = Duration::from_secs(10);
/// How long a stream may stay quiet before a read fails the test.
pub const READ: Duration = Duration::from_secs(30);

/// A channel to `endpoint` (with its TLS settings, if any), connected within [`CONNECT`].
pub async fn connect(endpoint: Endpoint) -> Result<Channel, tonic::transport::Error> {
    endpoint.connect_timeout(CONNECT).connect().await
}

/// The next message of `stream` (`Ok(None)` at its end), within [`READ`]; panics when the
/// server sends nothing for that long.
pub async fn next_message<T>(stream: &mut Streaming<T>) -> Result<Option<T>, tonic::Status> {
    tokio::time::timeout(READ, stream.message())
        .await
        .unwrap_or_else(|_| panic!("no message on the gRPC stream within {READ:?}"))
}

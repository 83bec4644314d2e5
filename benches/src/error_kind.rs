//! Why a request failed, in the buckets the report counts.

use std::fmt;

/// The kind of a failed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ErrorKind {
    /// The TCP connection or the HTTP handshake failed.
    Connect,
    /// No complete response within the request timeout.
    Timeout,
    /// The server answered with a non-2xx status.
    Status(u16),
    /// The connection failed while sending the request or reading the response.
    Io,
    /// A stream ended without its `[DONE]` line.
    IncompleteStream,
    /// A stream carried an error object instead of a chunk.
    StreamError,
}

impl ErrorKind {
    /// Whether the connection must be dropped after this error (its state is unknown).
    pub fn poisons_connection(self) -> bool {
        !matches!(self, Self::Status(_) | Self::StreamError)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Connect => f.write_str("connect"),
            Self::Timeout => f.write_str("timeout"),
            Self::Status(code) => write!(f, "status_{code}"),
            Self::Io => f.write_str("io"),
            Self::IncompleteStream => f.write_str("incomplete_stream"),
            Self::StreamError => f.write_str("stream_error"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(ErrorKind::Status(503).to_string(), "status_503");
        assert_eq!(ErrorKind::Connect.to_string(), "connect");
        assert_eq!(ErrorKind::IncompleteStream.to_string(), "incomplete_stream");
    }

    #[test]
    fn only_transport_failures_drop_the_connection() {
        assert!(!ErrorKind::Status(500).poisons_connection());
        assert!(ErrorKind::Timeout.poisons_connection());
        assert!(ErrorKind::Io.poisons_connection());
    }
}

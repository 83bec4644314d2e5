//! One ext_proc stream as the exchange sees it: the gateway's messages in, the picker's
//! answers out.

use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

/// Answers waiting to be written to one stream (the gateway reads them in order).
pub(crate) const ANSWER_BUFFER: usize = 8;

/// Where a stream's answers go.
pub(crate) type Answers = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// One ext_proc stream.
pub(crate) struct Wire {
    inbound: Streaming<ProcessingRequest>,
    out: Answers,
}

impl Wire {
    /// The stream whose messages come from `inbound` and whose answers go to `out`.
    pub(crate) fn new(inbound: Streaming<ProcessingRequest>, out: Answers) -> Self {
        Self { inbound, out }
    }

    /// The gateway's next message; `None` when it closed or reset the stream (the request
    /// is over, whatever state it was in).
    pub(crate) async fn next(&mut self) -> Option<ProcessingRequest> {
        match self.inbound.message().await {
            Ok(message) => message,
            Err(status) => {
                tracing::debug!(%status, "the gateway ended an ext_proc stream");
                None
            }
        }
    }

    /// Sends `answer`; `false` when the gateway is gone.
    pub(crate) async fn send(&self, answer: ProcessingResponse) -> bool {
        self.out.send(Ok(answer)).await.is_ok()
    }

    /// Ends the stream with `status` (a protocol error).
    pub(crate) async fn fail(&self, status: Status) {
        let _ = self.out.send(Err(status)).await;
    }
}

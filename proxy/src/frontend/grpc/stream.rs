//! ModelStreamInfer: the requests of one call run concurrently (up to
//! `grpc.max_stream_requests`), their responses interleaved on the one response stream
//! and told apart by request `id`. A request that fails gets a message with
//! `error_message` set and the stream goes on; a request that cannot be read, or the
//! call's deadline, ends the stream with a status. When the client half-closes, the
//! stream ends once every request has been answered; when it goes away, every request
//! still running is cancelled (its engine request dropped).

use std::sync::Arc;

use kvmesh_proto::inference::{ModelInferRequest, ModelInferResponse, ModelStreamInferResponse};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::frontend::grpc::call::Call;
use crate::frontend::grpc::catalog::MODEL_VERSION;
use crate::frontend::grpc::failure::Failure;
use crate::frontend::grpc::frontend::{Sink, StreamItem};
use crate::frontend::grpc::infer::{Shared, infer};
use crate::metrics::rpc::Rpc;

/// Responses buffered per stream before requests wait for the client to read.
const STREAM_BUFFER: usize = 64;

/// The response stream of one ModelStreamInfer call over `requests`.
pub(crate) fn model_stream_infer(
    shared: Arc<Shared>,
    requests: Streaming<ModelInferRequest>,
    call: Call,
) -> ReceiverStream<StreamItem> {
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    tokio::spawn(dispatch(shared, requests, tx, Arc::new(call)));
    ReceiverStream::new(rx)
}

/// What ended the reading of requests.
enum Next {
    Request(ModelInferRequest, OwnedSemaphorePermit),
    HalfClosed,
    Failed(Status),
    Gone,
}

/// Reads requests and starts each; returns when the stream is over.
async fn dispatch(
    shared: Arc<Shared>,
    mut requests: Streaming<ModelInferRequest>,
    tx: mpsc::Sender<StreamItem>,
    call: Arc<Call>,
) {
    let slots = Arc::new(Semaphore::new(shared.max_stream_requests));
    let mut running = JoinSet::new();
    let expired = async {
        match call.deadline {
            Some(at) => sleep_until(at).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(expired);
    let mut ended = false;
    loop {
        let next = tokio::select! {
            biased;
            () = tx.closed() => Next::Gone,
            () = &mut expired => Next::Failed(Failure::Deadline.status()),
            next = next_request(&mut requests, &slots) => next,
        };
        match next {
            Next::Request(request, slot) => {
                running.spawn(run(
                    Arc::clone(&shared),
                    request,
                    tx.clone(),
                    slot,
                    Arc::clone(&call),
                ));
            }
            Next::HalfClosed | Next::Gone => break,
            Next::Failed(status) => {
                let _ = tx.send(Err(status)).await;
                running.abort_all();
                ended = true;
                break;
            }
        }
        while running.try_join_next().is_some() {}
    }
    // Requests still running finish (or see the client leave), unless the deadline
    // passes first; then the stream ends.
    if !ended {
        let expired_first = tokio::select! {
            biased;
            () = &mut expired => true,
            () = async { while running.join_next().await.is_some() {} } => false,
        };
        // A request that saw the deadline itself ends quietly, at the same instant:
        // the stream still ends with DEADLINE_EXCEEDED, not as if every answer came.
        let past_deadline = call.deadline.is_some_and(|at| Instant::now() >= at);
        if expired_first || past_deadline {
            let _ = tx.send(Err(Failure::Deadline.status())).await;
            running.abort_all();
        }
    }
    drop(tx);
    while running.join_next().await.is_some() {}
}

/// The next request, once a slot for it is free.
async fn next_request(requests: &mut Streaming<ModelInferRequest>, slots: &Arc<Semaphore>) -> Next {
    let Ok(slot) = Arc::clone(slots).acquire_owned().await else {
        return Next::Gone;
    };
    match requests.message().await {
        Ok(Some(request)) => Next::Request(request, slot),
        Ok(None) => Next::HalfClosed,
        Err(status) => Next::Failed(status),
    }
}

/// Serves one request of the stream.
async fn run(
    shared: Arc<Shared>,
    request: ModelInferRequest,
    tx: mpsc::Sender<StreamItem>,
    _slot: OwnedSemaphorePermit,
    call: Arc<Call>,
) {
    // A failure is reported with the request's name and id, so the client can tell
    // which of its requests it concerns.
    let bare = ModelInferResponse {
        model_name: request.model_name.clone(),
        model_version: MODEL_VERSION.to_string(),
        id: request.id.clone(),
        ..Default::default()
    };
    let mut sink = Sink::Stream(tx.clone());
    let Err(failure) = infer(&shared, request, Rpc::ModelStreamInfer, &mut sink, &call).await
    else {
        return;
    };
    if matches!(failure, Failure::Cancelled | Failure::Deadline) {
        return;
    }
    let _ = tx
        .send(Ok(ModelStreamInferResponse {
            error_message: failure.stream_message(&bare.id),
            infer_response: Some(bare),
        }))
        .await;
}

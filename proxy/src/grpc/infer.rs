//! One inference request through the shared path: model lookup, translation to an
//! OpenAI completion, the same preprocessing and routing as the HTTP listeners
//! ([`Picker::for_request`]), forwarding with failover ([`forward`]), and the answer
//! translated back ([`GrpcDownstream`]).

use std::sync::Arc;

use arc_swap::ArcSwap;
use http::HeaderValue;
use http::header::CONTENT_TYPE;
use kvmesh_proto::inference::ModelInferRequest;
use pingora_http::RequestHeader;
use tokio::time::{Instant, timeout_at};

use crate::api_error::ApiError;
use crate::data_app::charge_prompt;
use crate::exchange::Exchange;
use crate::forward::{Picker, forward};
use crate::grpc::admission::{Credentials, admit_key, authenticate, model_slot};
use crate::grpc::catalog::is_served_version;
use crate::grpc::completion::completion;
use crate::grpc::downstream::{GrpcDownstream, Sink};
use crate::grpc::failure::Failure;
use crate::grpc::invalid::InvalidInput;
use crate::grpc::outputs::Reply;
use crate::grpc::record::Record;
use crate::grpc::rpc::Rpc;
use crate::kv_route::prepare::InvalidPrompt;
use crate::metrics::{NO_MODEL, RpcTable};
use crate::respond::JSON;
use crate::route::Route;
use crate::state::State;

/// The engine endpoint every gRPC inference request goes to.
const COMPLETIONS_PATH: &[u8] = b"/v1/completions";

/// What the gRPC service shares between requests.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The proxy's current state (models, routing, limits, metrics), shared with the HTTP
    /// listeners and replaced by reloads; each request loads it once.
    pub(crate) state: Arc<ArcSwap<State>>,
    /// Head of every engine request: `POST /v1/completions`, JSON.
    head: RequestHeader,
    /// Largest engine answer accepted (a response must fit in one message).
    max_message_bytes: usize,
    /// Requests one ModelStreamInfer stream may have in flight.
    pub(crate) max_stream_requests: usize,
    /// Metrics of requests that name no served model.
    unattributed: RpcTable,
}

impl Shared {
    /// The shared part of the service over `state`.
    pub(crate) fn new(
        state: Arc<ArcSwap<State>>,
        max_message_bytes: usize,
        max_stream_requests: usize,
    ) -> Result<Self, pingora_error::BError> {
        let mut head = RequestHeader::build("POST", COMPLETIONS_PATH, Some(1))?;
        head.insert_header(CONTENT_TYPE, JSON)?;
        // The metric families outlive reloads: one table serves every state.
        let unattributed = state.load().metrics.rpcs(NO_MODEL);
        Ok(Self {
            state,
            head,
            max_message_bytes,
            max_stream_requests,
            unattributed,
        })
    }
}

/// What a served request tells the client beside its responses.
#[derive(Debug)]
pub(crate) struct Served {
    /// The request id (the request's `id` when usable as one, else generated).
    pub(crate) request_id: HeaderValue,
    /// The instance that answered.
    pub(crate) instance: Option<HeaderValue>,
    /// Why `policy: kv` chose it (`x-kvmesh-route`).
    pub(crate) kv_route: Option<HeaderValue>,
}

/// What a call carries besides its requests.
#[derive(Debug, Clone, Default)]
pub(crate) struct Call {
    /// The `authorization` metadata (the API key).
    pub(crate) credentials: Credentials,
    /// When the call must end (`grpc-timeout`).
    pub(crate) deadline: Option<Instant>,
}

/// Serves `request` on `rpc` within `call`: its responses go to `sink`.
pub(crate) async fn infer(
    shared: &Shared,
    request: ModelInferRequest,
    rpc: Rpc,
    sink: &mut Sink,
    call: &Call,
) -> Result<Served, Failure> {
    // The state this request runs on to its end, whatever reloads happen meanwhile.
    let state = shared.state.load_full();
    let client_id = HeaderValue::from_str(&request.id).ok();
    let request_id = state.request_ids.resolve(client_id.as_ref());
    let mut record = Record::new(
        Exchange::new(request_id),
        rpc,
        &state.metrics,
        &shared.unattributed,
        call.deadline,
    );
    let work = serve(
        shared,
        &state,
        &request,
        rpc,
        sink,
        call,
        &mut record.exchange,
    );
    let outcome = match call.deadline {
        Some(at) => timeout_at(at, work).await.unwrap_or(Err(Failure::Deadline)),
        None => work.await,
    };
    record.finish(outcome.as_ref().map(|_| ()));
    outcome?;
    Ok(Served {
        request_id: record.exchange.request_id.clone(),
        instance: record.exchange.instance.clone(),
        kv_route: record.exchange.kv_route.clone(),
    })
}

async fn serve(
    shared: &Shared,
    state: &State,
    request: &ModelInferRequest,
    rpc: Rpc,
    sink: &mut Sink,
    call: &Call,
    exchange: &mut Exchange,
) -> Result<(), Failure> {
    let key = authenticate(state, &call.credentials)?;
    if request.model_name.is_empty() {
        return Err(Failure::Api(ApiError::MissingModel));
    }
    let Some(pool) = state.registry.get(&request.model_name) else {
        return Err(Failure::Api(ApiError::ModelNotFound {
            model: request.model_name.clone(),
            known: state.registry.known(),
        }));
    };
    exchange.pool = Some(Arc::clone(&pool));
    if !is_served_version(&request.model_version) {
        return Err(Failure::NoSuchVersion {
            model: request.model_name.clone(),
            version: request.model_version.clone(),
        });
    }
    let reply = Reply::to(request).map_err(Failure::Invalid)?;
    let completion = completion(request, pool.name()).map_err(Failure::Invalid)?;
    if rpc == Rpc::ModelInfer && completion.stream {
        return Err(Failure::Invalid(InvalidInput::new(
            "ModelInfer answers once: send streaming requests on ModelStreamInfer",
        )));
    }
    exchange.route = Some(Route::Completions);
    exchange.stream = completion.stream;
    let permit = admit_key(state, key, pool.name())?;
    let _slot = model_slot(state, pool.name(), sink).await?;
    let mut body = completion.body;
    let picker = Picker::for_request(state, &pool, Route::Completions, &mut body)
        .await
        .map_err(|InvalidPrompt(message)| Failure::Api(ApiError::InvalidPrompt(message)))?;
    if let Some(permit) = permit.as_ref() {
        charge_prompt(permit, &picker, body.len(), exchange);
    }
    let mut client = GrpcDownstream::new(
        &shared.head,
        sink,
        &reply,
        completion.stream,
        shared.max_message_bytes,
    );
    forward(state, &mut client, &pool, body, picker, exchange).await;
    if let Some(failure) = client.into_failure() {
        return Err(failure);
    }
    if exchange.client_gone {
        return Err(Failure::Cancelled);
    }
    Ok(())
}

//! One inference request: the API key, the model and version checked, the request
//! translated to an OpenAI completion, then the spine ([`crate::request::proxy`]), as for
//! the HTTP listeners, with the answer translated back ([`GrpcClient`]).

use std::sync::Arc;

use arc_swap::ArcSwap;
use http::HeaderValue;
use http::header::CONTENT_TYPE;
use kvmesh_proto::inference::ModelInferRequest;
use kvmesh_wire::kserve::completion::completion;
use kvmesh_wire::kserve::invalid::InvalidInput;
use pingora_http::RequestHeader;
use tokio::time::timeout_at;

use crate::edge::auth::{ApiKey, AuthFailure};
use crate::frontend::grpc::call::{Call, Credentials};
use crate::frontend::grpc::catalog::is_served_version;
use crate::frontend::grpc::failure::Failure;
use crate::frontend::grpc::frontend::{GrpcClient, Sink};
use crate::frontend::grpc::outputs::Reply;
use crate::frontend::grpc::rpc_record::RpcRecord;
use crate::frontend::respond::JSON;
use crate::metrics::families::{NO_MODEL, RpcTable};
use crate::metrics::rpc::Rpc;
use crate::openai::api_error::ApiError;
use crate::openai::route::Route;
use crate::request::body::RequestBody;
use crate::request::proxy;
use crate::request::record::Record;
use crate::state::shared::State;

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
    let mut record = RpcRecord::new(
        Record::new(request_id),
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
        &mut record.record,
    );
    let outcome = match call.deadline {
        Some(at) => timeout_at(at, work).await.unwrap_or(Err(Failure::Deadline)),
        None => work.await,
    };
    record.finish(outcome.as_ref().map(|_| ()));
    outcome?;
    Ok(Served {
        request_id: record.record.request_id.clone(),
        instance: record.record.instance.clone(),
        kv_route: record.record.kv_route.clone(),
    })
}

/// Checks and translates `request`, then hands it to the spine.
async fn serve(
    shared: &Shared,
    state: &State,
    request: &ModelInferRequest,
    rpc: Rpc,
    sink: &mut Sink,
    call: &Call,
    record: &mut Record,
) -> Result<(), Failure> {
    let key = authenticate(state, &call.credentials)?;
    if request.model_name.is_empty() {
        return Err(Failure::Api(ApiError::MissingModel));
    }
    let Some(served) = state.registry.resolve(&request.model_name) else {
        return Err(Failure::Api(ApiError::ModelNotFound {
            model: request.model_name.clone(),
            known: state.registry.known(),
        }));
    };
    record.pool = Some(Arc::clone(&served.pool));
    if !is_served_version(&request.model_version) {
        return Err(Failure::NoSuchVersion {
            model: request.model_name.clone(),
            version: request.model_version.clone(),
        });
    }
    let reply = Reply::to(request).map_err(Failure::Invalid)?;
    let engine_model = served.adapter.as_deref().unwrap_or(served.pool.name());
    let completion = completion(request, engine_model).map_err(Failure::Invalid)?;
    if rpc == Rpc::ModelInfer && completion.stream {
        return Err(Failure::Invalid(InvalidInput::new(
            "ModelInfer answers once: send streaming requests on ModelStreamInfer",
        )));
    }
    record.route = Some(Route::Completions);
    let mut client = GrpcClient::new(
        &shared.head,
        call,
        sink,
        &reply,
        completion.stream,
        shared.max_message_bytes,
    );
    proxy(
        state,
        &mut client,
        record,
        key,
        RequestBody::whole(completion.body),
    )
    .await;
    if let Some(failure) = client.into_failure() {
        return Err(failure);
    }
    if record.client_gone {
        return Err(Failure::Cancelled);
    }
    Ok(())
}

/// The key `credentials` present; `None` when authentication is off.
fn authenticate(state: &State, credentials: &Credentials) -> Result<Option<Arc<ApiKey>>, Failure> {
    state
        .auth
        .authenticate_value(credentials.as_deref())
        .map_err(|failure| {
            Failure::Api(ApiError::Unauthorized {
                missing: failure == AuthFailure::Missing,
            })
        })
}

//! `GRPCInferenceService`: health and metadata answered from the registry, inference
//! through the shared routing and forwarding path, every other RPC UNIMPLEMENTED.

use std::sync::Arc;

use kvmesh_proto::inference::grpc_inference_service_server::GrpcInferenceService;
use kvmesh_proto::inference::{
    CudaSharedMemoryRegisterRequest, CudaSharedMemoryRegisterResponse,
    CudaSharedMemoryStatusRequest, CudaSharedMemoryStatusResponse,
    CudaSharedMemoryUnregisterRequest, CudaSharedMemoryUnregisterResponse, LogSettingsRequest,
    LogSettingsResponse, ModelConfigRequest, ModelConfigResponse, ModelInferRequest,
    ModelInferResponse, ModelMetadataRequest, ModelMetadataResponse, ModelReadyRequest,
    ModelReadyResponse, ModelStatisticsRequest, ModelStatisticsResponse, RepositoryIndexRequest,
    RepositoryIndexResponse, RepositoryModelLoadRequest, RepositoryModelLoadResponse,
    RepositoryModelUnloadRequest, RepositoryModelUnloadResponse, ServerLiveRequest,
    ServerLiveResponse, ServerMetadataRequest, ServerMetadataResponse, ServerReadyRequest,
    ServerReadyResponse, SystemSharedMemoryRegisterRequest, SystemSharedMemoryRegisterResponse,
    SystemSharedMemoryStatusRequest, SystemSharedMemoryStatusResponse,
    SystemSharedMemoryUnregisterRequest, SystemSharedMemoryUnregisterResponse, TraceSettingRequest,
    TraceSettingResponse,
};
use kvmesh_telemetry::traceparent::{TRACEPARENT, TRACESTATE};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::{Request, Response, Status, Streaming};

use crate::engines::clock::now_millis;
use crate::engines::pool::ModelPool;
use crate::frontend::grpc::call::Call;
use crate::frontend::grpc::catalog::{
    is_served_version, model_config, model_metadata, server_metadata,
};
use crate::frontend::grpc::deadline::deadline;
use crate::frontend::grpc::failure::Failure;
use crate::frontend::grpc::frontend::{Sink, StreamItem};
use crate::frontend::grpc::infer::{Served, Shared, infer};
use crate::frontend::grpc::stream::model_stream_infer;
use crate::metrics::rpc::Rpc;

/// The KServe v2 inference service of the proxy.
#[derive(Debug, Clone)]
pub(crate) struct KserveService {
    shared: Arc<Shared>,
}

impl KserveService {
    /// The service over `shared`.
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// The served model `name` (a LoRA adapter: its base model's pool) in `version`, or
    /// NOT_FOUND.
    fn model(&self, name: &str, version: &str) -> Result<Arc<ModelPool>, Status> {
        let state = self.shared.state.load();
        let registry = &state.registry;
        let Some(pool) = registry.resolve(name).map(|served| served.pool) else {
            return Err(Status::not_found(format!(
                "the model {name:?} does not exist; known models: {}",
                registry.known()
            )));
        };
        if !is_served_version(version) {
            return Err(Failure::NoSuchVersion {
                model: name.to_string(),
                version: version.to_string(),
            }
            .status());
        }
        Ok(pool)
    }
}

/// Whether some instance of `pool` takes requests now.
fn is_ready(pool: &ModelPool) -> bool {
    let now = now_millis();
    pool.instances().iter().any(|i| i.is_available(now))
}

/// What the call's metadata says: its API key, deadline and trace context.
fn call(metadata: &MetadataMap) -> Call {
    Call {
        credentials: metadata
            .get("authorization")
            .map(|value| Arc::from(value.as_bytes())),
        deadline: deadline(metadata, Instant::now()),
        traceparent: metadata.get(TRACEPARENT).cloned(),
        tracestate: metadata.get(TRACESTATE).cloned(),
    }
}

/// UNIMPLEMENTED, naming the RPC.
fn unimplemented(rpc: &str) -> Status {
    Status::unimplemented(format!(
        "kvmesh does not implement {rpc}; it serves ServerLive, ServerReady, ModelReady, \
         ServerMetadata, ModelMetadata, ModelConfig, ModelInfer and ModelStreamInfer"
    ))
}

/// `x-request-id`, `x-kvmesh-instance` and (`policy: kv`) `x-kvmesh-route`, as on the
/// HTTP side.
fn served_metadata(metadata: &mut MetadataMap, served: &Served) {
    let ascii = |value: &http::HeaderValue| {
        value
            .to_str()
            .ok()
            .and_then(|text| AsciiMetadataValue::try_from(text).ok())
    };
    if let Some(id) = ascii(&served.request_id) {
        metadata.insert("x-request-id", id);
    }
    if let Some(instance) = served.instance.as_ref().and_then(ascii) {
        metadata.insert("x-kvmesh-instance", instance);
    }
    if let Some(route) = served.kv_route.as_ref().and_then(ascii) {
        metadata.insert("x-kvmesh-route", route);
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for KserveService {
    async fn server_live(
        &self,
        _request: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _request: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        let ready = self
            .shared
            .state
            .load()
            .registry
            .pools()
            .iter()
            .any(|pool| is_ready(pool));
        Ok(Response::new(ServerReadyResponse { ready }))
    }

    async fn model_ready(
        &self,
        request: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let request = request.into_inner();
        let ready = self
            .shared
            .state
            .load()
            .registry
            .get(&request.name)
            .is_some_and(|pool| is_served_version(&request.version) && is_ready(&pool));
        Ok(Response::new(ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _request: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(server_metadata()))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let request = request.into_inner();
        let pool = self.model(&request.name, &request.version)?;
        Ok(Response::new(model_metadata(pool.name())))
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let call = call(request.metadata());
        let mut sink = Sink::Unary(None);
        let served = infer(
            &self.shared,
            request.into_inner(),
            Rpc::ModelInfer,
            &mut sink,
            &call,
        )
        .await
        .map_err(|failure| failure.status())?;
        let Some(answer) = sink.take_response() else {
            return Err(Status::internal("the engine's answer could not be relayed"));
        };
        let mut response = Response::new(answer);
        served_metadata(response.metadata_mut(), &served);
        Ok(response)
    }

    type ModelStreamInferStream = ReceiverStream<StreamItem>;

    async fn model_stream_infer(
        &self,
        request: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let call = call(request.metadata());
        Ok(Response::new(model_stream_infer(
            Arc::clone(&self.shared),
            request.into_inner(),
            call,
        )))
    }

    async fn model_config(
        &self,
        request: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        let request = request.into_inner();
        let pool = self.model(&request.name, &request.version)?;
        Ok(Response::new(ModelConfigResponse {
            config: Some(model_config(pool.name())),
        }))
    }

    async fn model_statistics(
        &self,
        _request: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        Err(unimplemented("ModelStatistics"))
    }

    async fn repository_index(
        &self,
        _request: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        Err(unimplemented("RepositoryIndex"))
    }

    async fn repository_model_load(
        &self,
        _request: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        Err(unimplemented("RepositoryModelLoad"))
    }

    async fn repository_model_unload(
        &self,
        _request: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        Err(unimplemented("RepositoryModelUnload"))
    }

    async fn system_shared_memory_status(
        &self,
        _request: Request<SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<SystemSharedMemoryStatusResponse>, Status> {
        Err(unimplemented("SystemSharedMemoryStatus"))
    }

    async fn system_shared_memory_register(
        &self,
        _request: Request<SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<SystemSharedMemoryRegisterResponse>, Status> {
        Err(unimplemented("SystemSharedMemoryRegister"))
    }

    async fn system_shared_memory_unregister(
        &self,
        _request: Request<SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<SystemSharedMemoryUnregisterResponse>, Status> {
        Err(unimplemented("SystemSharedMemoryUnregister"))
    }

    async fn cuda_shared_memory_status(
        &self,
        _request: Request<CudaSharedMemoryStatusRequest>,
    ) -> Result<Response<CudaSharedMemoryStatusResponse>, Status> {
        Err(unimplemented("CudaSharedMemoryStatus"))
    }

    async fn cuda_shared_memory_register(
        &self,
        _request: Request<CudaSharedMemoryRegisterRequest>,
    ) -> Result<Response<CudaSharedMemoryRegisterResponse>, Status> {
        Err(unimplemented("CudaSharedMemoryRegister"))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        _request: Request<CudaSharedMemoryUnregisterRequest>,
    ) -> Result<Response<CudaSharedMemoryUnregisterResponse>, Status> {
        Err(unimplemented("CudaSharedMemoryUnregister"))
    }

    async fn trace_setting(
        &self,
        _request: Request<TraceSettingRequest>,
    ) -> Result<Response<TraceSettingResponse>, Status> {
        Err(unimplemented("TraceSetting"))
    }

    async fn log_settings(
        &self,
        _request: Request<LogSettingsRequest>,
    ) -> Result<Response<LogSettingsResponse>, Status> {
        Err(unimplemented("LogSettings"))
    }
}

//! The gRPC listener: `GRPCInferenceService`, `grpc.health.v1.Health` and server
//! reflection (v1 and v1alpha, for grpcurl) on their own port: h2c, or TLS when a data
//! listener terminates TLS ([`incoming`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use kvmesh_config::{GRPC_LISTENER, GrpcConfig};
use kvmesh_proto::inference::grpc_inference_service_server::GrpcInferenceServiceServer;
use tokio::net::TcpListener;
use tonic::transport::Server;

use crate::edge::error::ProxyError;
use crate::edge::tls::ListenerTls;
use crate::frontend::grpc::incoming;
use crate::frontend::grpc::infer::Shared;
use crate::frontend::grpc::service::KserveService;
use crate::state::shared::State;

/// A bound gRPC listener, ready to serve.
#[derive(Debug)]
pub(crate) struct GrpcListener {
    socket: TcpListener,
    address: SocketAddr,
    max_message_bytes: usize,
    max_stream_requests: usize,
}

impl GrpcListener {
    /// Binds `config.address`; `None` when the listener is off.
    pub(crate) async fn bind(config: &GrpcConfig) -> Result<Option<Self>, ProxyError> {
        let Some(address) = config.address else {
            return Ok(None);
        };
        let (socket, address) = incoming::bind(GRPC_LISTENER, address).await?;
        Ok(Some(Self {
            socket,
            address,
            max_message_bytes: config.max_message_bytes,
            max_stream_requests: config.max_stream_requests,
        }))
    }

    /// The bound address (the real port when the config said 0).
    pub(crate) fn address(&self) -> SocketAddr {
        self.address
    }

    /// Serves `state` until `shutdown` completes, then stops accepting, lets calls in
    /// flight finish for up to `drain_timeout` and returns. With `tls`, connections are
    /// TLS (handshake within `handshake_timeout`).
    pub(crate) async fn serve(
        self,
        state: Arc<ArcSwap<State>>,
        tls: Option<Arc<ListenerTls>>,
        handshake_timeout: Duration,
        shutdown: impl Future<Output = ()> + Send + 'static,
        drain_timeout: Duration,
    ) -> Result<(), ProxyError> {
        let shared = Shared::new(state, self.max_message_bytes, self.max_stream_requests)
            .map_err(|error| ProxyError::Grpc(error.to_string()))?;
        let inference = GrpcInferenceServiceServer::new(KserveService::new(Arc::new(shared)))
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes);
        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<GrpcInferenceServiceServer<KserveService>>()
            .await;
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(kvmesh_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let reflection_v1 = reflection()
            .build_v1()
            .map_err(|error| ProxyError::Grpc(error.to_string()))?;
        let reflection_v1alpha = reflection()
            .build_v1alpha()
            .map_err(|error| ProxyError::Grpc(error.to_string()))?;
        let incoming = incoming::incoming(self.socket, tls, handshake_timeout);
        let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
        let signal = async move {
            shutdown.await;
            health
                .set_not_serving::<GrpcInferenceServiceServer<KserveService>>()
                .await;
            let _ = stopping_tx.send(());
        };
        let server = Server::builder()
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(inference)
            .serve_with_incoming_shutdown(incoming, signal);
        incoming::serve_draining(server, stopping_rx, drain_timeout, GRPC_LISTENER).await
    }
}

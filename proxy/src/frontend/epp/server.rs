//! The endpoint picker listener: `envoy.service.ext_proc.v3.ExternalProcessor` and
//! `grpc.health.v1.Health` (`liveness`, `readiness`, and the ext_proc service's name) on
//! their own port: h2c, or TLS with the first TLS data listener's certificate.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use kvmesh_config::{EPP_LISTENER, EppConfig};
use kvmesh_route::kv::KvRouter;
use prometheus::IntGauge;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Server;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::edge::error::ProxyError;
use crate::edge::tls::ListenerTls;
use crate::frontend::epp::exchange::exchange;
use crate::frontend::epp::settings::Settings;
use crate::frontend::epp::wire::{ANSWER_BUFFER, Wire};
use crate::frontend::grpc::incoming;
use crate::state::shared::State;

/// The health service name of the ext_proc service.
const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// How often readiness is checked until the picker is ready.
const READINESS_POLL: Duration = Duration::from_millis(100);
/// Bytes of a message beyond the request body it may carry (headers, metadata).
const MESSAGE_OVERHEAD_BYTES: usize = 64 * 1024;

/// The ext_proc service: each stream is one request's exchange, served by its own task.
struct EndpointPicker {
    state: Arc<ArcSwap<State>>,
    settings: Arc<Settings>,
}

#[tonic::async_trait]
impl ExternalProcessor for EndpointPicker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (answers, out) = mpsc::channel(ANSWER_BUFFER);
        let wire = Wire::new(request.into_inner(), answers);
        tokio::spawn(exchange(
            self.state.load_full(),
            Arc::clone(&self.settings),
            wire,
        ));
        Ok(Response::new(ReceiverStream::new(out)))
    }
}

/// A bound endpoint picker listener, ready to serve.
#[derive(Debug)]
pub(crate) struct EppListener {
    socket: TcpListener,
    address: SocketAddr,
    settings: Settings,
}

impl EppListener {
    /// Binds `config.address`; `None` when the picker is off.
    pub(crate) async fn bind(config: &EppConfig) -> Result<Option<Self>, ProxyError> {
        let Some(address) = config.address else {
            return Ok(None);
        };
        let (socket, address) = incoming::bind(EPP_LISTENER, address).await?;
        Ok(Some(Self {
            socket,
            address,
            settings: Settings::new(config),
        }))
    }

    /// The bound address (the real port when the config said 0).
    pub(crate) fn address(&self) -> SocketAddr {
        self.address
    }

    /// Serves `state` until `shutdown` completes, then reports not ready, stops accepting,
    /// lets open streams finish for up to `drain_timeout` and returns. Readiness waits for
    /// discovery's first listing (`discovery_synced`, when discovery is dynamic) and for
    /// every event-fed KV index to be synced once.
    pub(crate) async fn serve(
        self,
        state: Arc<ArcSwap<State>>,
        discovery_synced: Option<IntGauge>,
        tls: Option<Arc<ListenerTls>>,
        handshake_timeout: Duration,
        shutdown: impl Future<Output = ()> + Send + 'static,
        drain_timeout: Duration,
    ) -> Result<(), ProxyError> {
        let max_body = usize::try_from(state.load().limits.max_body_bytes).unwrap_or(usize::MAX);
        let max_message = max_body.saturating_add(MESSAGE_OVERHEAD_BYTES);
        let picker = EndpointPicker {
            state: Arc::clone(&state),
            settings: Arc::new(self.settings),
        };
        let service = ExternalProcessorServer::new(picker)
            .max_decoding_message_size(max_message)
            .max_encoding_message_size(max_message);
        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_service_status("liveness", ServingStatus::Serving)
            .await;
        for service in ["readiness", EXT_PROC_SERVICE] {
            health
                .set_service_status(service, ServingStatus::NotServing)
                .await;
        }
        let reporter = health.clone();
        let readiness = tokio::spawn(async move {
            report_readiness(&reporter, &state, discovery_synced.as_ref()).await;
        });
        let incoming = incoming::incoming(self.socket, tls, handshake_timeout);
        let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
        let signal = async move {
            shutdown.await;
            readiness.abort();
            for service in ["readiness", EXT_PROC_SERVICE] {
                health
                    .set_service_status(service, ServingStatus::NotServing)
                    .await;
            }
            let _ = stopping_tx.send(());
        };
        let server = Server::builder()
            .add_service(health_service)
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, signal);
        incoming::serve_draining(server, stopping_rx, drain_timeout, EPP_LISTENER).await
    }
}

/// Reports `readiness` and the ext_proc service serving once the picker [`is_ready`]; they
/// stay so until shutdown (a bus lost later leaves the index in approximate mode, as on the
/// proxy's own listeners, and picks go on).
async fn report_readiness(
    reporter: &HealthReporter,
    state: &ArcSwap<State>,
    discovery_synced: Option<&IntGauge>,
) {
    while !is_ready(&state.load(), discovery_synced) {
        tokio::time::sleep(READINESS_POLL).await;
    }
    tracing::info!("endpoint picker ready: discovery and KV events synced");
    for service in ["readiness", EXT_PROC_SERVICE] {
        reporter
            .set_service_status(service, ServingStatus::Serving)
            .await;
    }
}

/// Whether discovery has listed its instances (always, for static backends) and every
/// event-fed KV index has been resynced from its agents.
fn is_ready(state: &State, discovery_synced: Option<&IntGauge>) -> bool {
    discovery_synced.is_none_or(|synced| synced.get() == 1)
        && state.registry.pools().iter().all(|pool| {
            pool.balancer()
                .kv_router()
                .and_then(KvRouter::event_feed)
                .is_none_or(|feed| feed.is_live())
        })
}

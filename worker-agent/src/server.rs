//! The agent's own HTTP endpoints: `GET /health` (200 while registered, 503 otherwise, with a
//! JSON body) and `GET /metrics` (Prometheus text).

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvmesh_control::{InstanceId, InstanceState};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::core::Core;
use crate::metrics::AgentMetrics;

/// What the endpoints report.
pub(crate) struct Status {
    pub instance_id: InstanceId,
    pub written: watch::Receiver<Option<InstanceState>>,
    pub core: Arc<Core>,
    pub metrics: AgentMetrics,
}

fn respond(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    if let Ok(value) = http::HeaderValue::from_str(content_type) {
        response
            .headers_mut()
            .insert(http::header::CONTENT_TYPE, value);
    }
    response
}

fn handle(status: &Status, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
    }
    match req.uri().path() {
        "/health" => {
            let written = *status.written.borrow();
            let body = serde_json::json!({
                "status": if written.is_some() { "registered" } else { "unregistered" },
                "state": written.map(InstanceState::as_str),
                "instance_id": status.instance_id.to_string(),
                "engine_healthy": status.metrics.engine_healthy.get() == 1,
                "last_seq": status.core.last_seq(),
            });
            let code = if written.is_some() {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            respond(code, "application/json", body.to_string())
        }
        "/metrics" => respond(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            status.metrics.render(),
        ),
        _ => respond(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

/// Serves connections on `listener` until aborted.
pub(crate) async fn serve(listener: TcpListener, status: Arc<Status>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let status = status.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let response = handle(&status, &req);
                async move { Ok::<_, Infallible>(response) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(error = %e, "agent HTTP connection ended");
            }
        });
    }
}

//! The inbound listener: every request to the pod goes through here to the local engine,
//! unchanged (method, path, headers but the hop-by-hop ones, body); the answer comes back as
//! the engine streams it, and a client that leaves drops the engine request. A decode leg
//! (a request carrying a remote prefill's `kv_transfer_params`) first waits for the
//! [`Pacer`] to admit its transfer, which it holds until the engine's first body byte.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use prometheus::IntCounterVec;
use tokio::net::TcpListener;

use kvmesh_h1::fields::{is_end_to_end, listed_in_connection};

use crate::sidecar::pacer::{Pacer, Permit};

/// Largest request body forwarded.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// The forwarder of one pod.
#[derive(Debug)]
pub(crate) struct Inbound {
    /// `http://host:port` of the local engine.
    engine: String,
    client: Client<HttpConnector, Full<Bytes>>,
    /// The transfer budget (`None`: decode legs are not paced).
    pacer: Option<Arc<Pacer>>,
    /// KV bytes one block moves.
    bytes_per_block: u64,
    /// `kvmesh_agent_inbound_requests_total{outcome}`.
    requests: IntCounterVec,
}

impl Inbound {
    /// A forwarder to the engine at `engine` (base URL), pacing decode legs with `pacer`.
    pub(crate) fn new(
        engine: &str,
        pacer: Option<Arc<Pacer>>,
        bytes_per_block: u64,
        requests: IntCounterVec,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        Self {
            engine: engine.trim_end_matches('/').to_owned(),
            client: Client::builder(TokioExecutor::new()).build(connector),
            pacer,
            bytes_per_block,
            requests,
        }
    }

    /// The KV bytes a decode leg of `body` will pull (`None`: not a decode leg).
    fn transfer_bytes(&self, path: &str, body: &[u8]) -> Option<u64> {
        if !matches!(path, "/v1/completions" | "/v1/chat/completions")
            || memchr::memmem::find(body, b"kv_transfer_params").is_none()
        {
            return None;
        }
        let request: serde_json::Value = serde_json::from_slice(body).ok()?;
        let params = request.get("kv_transfer_params")?;
        if params.get("do_remote_prefill")? != true {
            return None;
        }
        Some(remote_blocks(params.get("remote_block_ids")?)? * self.bytes_per_block)
    }

    async fn forward(&self, request: Request<Incoming>) -> Response<ForwardBody> {
        let (parts, body) = request.into_parts();
        let body = match Limited::new(body, MAX_BODY_BYTES).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(error) => {
                self.count("bad_request");
                return error_response(StatusCode::BAD_REQUEST, &format!("request body: {error}"));
            }
        };
        let permit = match (&self.pacer, self.transfer_bytes(parts.uri.path(), &body)) {
            (Some(pacer), Some(bytes)) => Some(pacer.admit(bytes).await),
            _ => None,
        };
        let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let mut upstream = Request::builder()
            .method(parts.method)
            .uri(format!("{}{target}", self.engine))
            .body(Full::new(body))
            .expect("a request built from a parsed one");
        *upstream.headers_mut() = end_to_end(parts.headers);
        upstream.headers_mut().remove(HOST);
        match self.client.request(upstream).await {
            Ok(response) => {
                self.count("forwarded");
                let (mut parts, body) = response.into_parts();
                parts.headers = end_to_end(parts.headers);
                Response::from_parts(
                    parts,
                    ForwardBody::Engine(PacedBody {
                        inner: body,
                        permit,
                    }),
                )
            }
            Err(error) => {
                self.count("engine_unreachable");
                error_response(
                    StatusCode::BAD_GATEWAY,
                    &format!("the engine did not answer: {error}"),
                )
            }
        }
    }

    fn count(&self, outcome: &str) {
        self.requests.with_label_values(&[outcome]).inc();
    }
}

/// `headers` without the hop-by-hop fields and those `Connection` names: the proxy's list
/// (`kvmesh_h1::fields`), so both hops drop the same fields.
fn end_to_end(mut headers: HeaderMap) -> HeaderMap {
    let dropped: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            let name = name.as_str().as_bytes();
            !is_end_to_end(name, None)
                || headers
                    .get_all(http::header::CONNECTION)
                    .iter()
                    .any(|value| listed_in_connection(value.as_bytes(), name))
        })
        .cloned()
        .collect();
    for name in dropped {
        headers.remove(name);
    }
    headers
}

/// An OpenAI-shaped error answered by the sidecar itself.
fn error_response(status: StatusCode, message: &str) -> Response<ForwardBody> {
    let body = serde_json::json!({"error": {
        "message": message, "type": "server_error", "param": null, "code": "sidecar",
    }});
    let mut response = Response::new(ForwardBody::Own(Full::new(Bytes::from(body.to_string()))));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// What the client gets: the engine's body, or the sidecar's own error.
pub(crate) enum ForwardBody {
    /// Streamed from the engine.
    Engine(PacedBody),
    /// Written here.
    Own(Full<Bytes>),
}

/// The engine's body, holding a decode leg's transfer permit until its first data frame
/// (the first token: the KV has arrived) or its end.
pub(crate) struct PacedBody {
    inner: Incoming,
    permit: Option<Permit>,
}

impl Body for ForwardBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            Self::Own(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|frame| frame.map(|f| f.map_err(|never| match never {}))),
            Self::Engine(paced) => {
                let polled = Pin::new(&mut paced.inner).poll_frame(cx);
                let transferred = match &polled {
                    Poll::Ready(Some(Ok(frame))) => frame.is_data(),
                    Poll::Ready(_) => true,
                    Poll::Pending => false,
                };
                if transferred {
                    paced.permit.take();
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Own(body) => body.is_end_stream(),
            Self::Engine(paced) => paced.inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Own(body) => body.size_hint(),
            Self::Engine(paced) => paced.inner.size_hint(),
        }
    }
}

/// Serves `listener` (HTTP/1.1 and h2c) until aborted.
pub(crate) async fn serve(listener: TcpListener, inbound: Arc<Inbound>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(connection) => connection,
            Err(error) => {
                tracing::warn!(%error, "inbound accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let inbound = Arc::clone(&inbound);
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let inbound = Arc::clone(&inbound);
                async move { Ok::<_, Infallible>(inbound.forward(request).await) }
            });
            if let Err(error) = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%error, "inbound connection ended");
            }
        });
    }
}

/// How many blocks `remote_block_ids` names: vLLM 0.32 sends one list per KV cache group
/// (`[[1, 2, 3]]`; a block of every group covers the same tokens, so the longest list counts),
/// older vLLM one flat list.
fn remote_blocks(ids: &serde_json::Value) -> Option<u64> {
    let ids = ids.as_array()?;
    let grouped = ids.iter().filter_map(serde_json::Value::as_array);
    match grouped.map(Vec::len).max() {
        Some(longest) => Some(longest as u64),
        None => Some(ids.len() as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_block_ids_count_in_vllm_032s_grouped_form_and_the_flat_one() {
        let count = |text: &str| remote_blocks(&serde_json::from_str(text).unwrap());
        // What a vLLM 0.32 prefill engine with NixlConnector answers: one full-attention group.
        assert_eq!(count("[[1,2,3,4,5,6,7,8,9,10]]"), Some(10));
        assert_eq!(count("[1,2,3]"), Some(3));
        assert_eq!(count("[]"), Some(0));
        assert_eq!(count("null"), None);
    }

    #[test]
    fn hop_by_hop_fields_and_those_connection_names_are_dropped_as_the_proxy_drops_them() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-private"),
            ("connection", "x-other"),
            ("keep-alive", "timeout=5"),
            ("x-private", "1"),
            ("x-other", "2"),
            ("te", "trailers"),
            ("proxy-authenticate", "Basic"),
            ("proxy-authorization", "Basic eA=="),
            ("expect", "100-continue"),
            ("content-type", "application/json"),
            ("x-request-id", "r1"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        let kept = end_to_end(headers);
        let mut names: Vec<&str> = kept.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-type", "x-request-id"]);
    }
}

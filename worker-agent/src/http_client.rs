//! A small HTTP client for the engine's `/health`, `/metrics` and other GETs, and the
//! body-less POST that polls TensorRT-LLM's KV cache events.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Largest engine response read (a `/metrics` page is far smaller).
const MAX_BODY: usize = 16 * 1024 * 1024;
/// Largest answer of a POST: a poll of TensorRT-LLM's KV cache events may hold a whole event
/// buffer (about 2.4 KB per stored block of 32 tokens).
const MAX_POST_BODY: usize = 128 * 1024 * 1024;

/// GETs (and POSTs to) paths under the engine's base URL.
#[derive(Debug, Clone)]
pub(crate) struct EngineClient {
    base: String,
    http: Client<HttpConnector, Empty<Bytes>>,
}

impl EngineClient {
    /// A client of the engine at `base` (`http://host:port`).
    pub(crate) fn new(base: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(1)));
        Self {
            base: base.trim_end_matches('/').to_owned(),
            http: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    /// GETs `path`; returns the status and body, or why it failed.
    pub(crate) async fn get(
        &self,
        path: &str,
        timeout: Duration,
    ) -> Result<(http::StatusCode, Bytes), String> {
        self.call(http::Method::GET, path, timeout, MAX_BODY).await
    }

    /// POSTs an empty body to `path`; returns the status and body (up to 128 MiB), or why it
    /// failed.
    pub(crate) async fn post(
        &self,
        path: &str,
        timeout: Duration,
    ) -> Result<(http::StatusCode, Bytes), String> {
        self.call(http::Method::POST, path, timeout, MAX_POST_BODY)
            .await
    }

    async fn call(
        &self,
        method: http::Method,
        path: &str,
        timeout: Duration,
        max_body: usize,
    ) -> Result<(http::StatusCode, Bytes), String> {
        let uri: http::Uri = format!("{}{path}", self.base)
            .parse()
            .map_err(|e| format!("bad engine URL: {e}"))?;
        let request = http::Request::builder()
            .method(method)
            .uri(uri)
            .body(Empty::new())
            .map_err(|e| format!("bad engine request: {e}"))?;
        let fut = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(|e| format!("engine request failed: {e}"))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), max_body)
                .collect()
                .await
                .map_err(|e| format!("reading the engine's answer: {e}"))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| format!("engine {path} timed out"))?
    }
}

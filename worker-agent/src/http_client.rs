//! A small HTTP GET client for the engine's `/health` and `/metrics`.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Largest engine response read (a `/metrics` page is far smaller).
const MAX_BODY: usize = 16 * 1024 * 1024;

/// GETs paths under the engine's base URL.
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
        let uri: http::Uri = format!("{}{path}", self.base)
            .parse()
            .map_err(|e| format!("bad engine URL: {e}"))?;
        let fut = async {
            let response = self
                .http
                .get(uri)
                .await
                .map_err(|e| format!("engine request failed: {e}"))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_BODY)
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

//! A small HTTP client over hyper for the Rust side of the end-to-end suite.

use std::time::Duration;

use anyhow::{Context, anyhow};
use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Time any single request may take before the test fails instead of hanging.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// A complete response.
#[derive(Debug)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// Response headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

impl Response {
    /// The body parsed as JSON.
    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_slice(&self.body).with_context(|| {
            format!(
                "body is not JSON: {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header's value as a string, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A response whose body is read chunk by chunk.
pub struct StreamingResponse {
    /// HTTP status code.
    pub status: u16,
    /// Response headers.
    pub headers: HeaderMap,
    body: Incoming,
}

impl StreamingResponse {
    /// The next data chunk; `Ok(None)` at the end of the body.
    pub async fn next_chunk(&mut self) -> anyhow::Result<Option<Bytes>> {
        loop {
            let Some(frame) = self.body.frame().await else {
                return Ok(None);
            };
            if let Ok(data) = frame?.into_data() {
                return Ok(Some(data));
            }
        }
    }

    /// Reads the rest of the body.
    pub async fn rest(mut self) -> anyhow::Result<Bytes> {
        let mut all = Vec::new();
        while let Some(chunk) = self.next_chunk().await? {
            all.extend_from_slice(&chunk);
        }
        Ok(all.into())
    }
}

/// A pooled HTTP/1.1 (or h2c) client.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::http1()
    }
}

impl HttpClient {
    /// An HTTP/1.1 client with keep-alive. A request on a pooled connection the server
    /// closed fails rather than being sent again on a new one (hyper-util's default), so a
    /// server that drops keep-alive connections it should keep (during a reload, say) fails
    /// the test instead of being hidden.
    pub fn http1() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            inner: Client::builder(TokioExecutor::new())
                .retry_canceled_requests(false)
                .build(connector),
        }
    }

    /// [`HttpClient::http1`] with a socket receive buffer of `bytes` (the kernel's minimum
    /// at least): a response it stops reading fills that little and then holds the server's
    /// writes, as a client that stalled does.
    pub fn http1_small_window(bytes: usize) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_recv_buffer_size(Some(bytes));
        Self {
            inner: Client::builder(TokioExecutor::new())
                .retry_canceled_requests(false)
                .build(connector),
        }
    }

    /// An h2c (HTTP/2 prior knowledge) client.
    pub fn h2c() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            inner: Client::builder(TokioExecutor::new())
                .retry_canceled_requests(false)
                .http2_only(true)
                .build(connector),
        }
    }

    /// Sends a request and returns the response head with a streaming body.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> anyhow::Result<StreamingResponse> {
        let mut builder = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let req = builder.body(Full::new(body.into()))?;
        let resp = tokio::time::timeout(REQUEST_TIMEOUT, self.inner.request(req))
            .await
            .map_err(|_| anyhow!("request to {url} timed out"))??;
        let (parts, body) = resp.into_parts();
        Ok(StreamingResponse {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
        })
    }

    /// Sends a request and reads the whole response.
    pub async fn call(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> anyhow::Result<Response> {
        let resp = self.send(method, url, headers, body).await?;
        let (status, headers) = (resp.status, resp.headers.clone());
        let body = tokio::time::timeout(REQUEST_TIMEOUT, resp.rest())
            .await
            .map_err(|_| anyhow!("reading body from {url} timed out"))??;
        Ok(Response {
            status,
            headers,
            body,
        })
    }

    /// `GET url`.
    pub async fn get(&self, url: &str) -> anyhow::Result<Response> {
        self.call(Method::GET, url, &[], Bytes::new()).await
    }

    /// `POST url` with a JSON body.
    pub async fn post_json(&self, url: &str, body: &serde_json::Value) -> anyhow::Result<Response> {
        self.call(
            Method::POST,
            url,
            &[("content-type", "application/json")],
            body.to_string(),
        )
        .await
    }
}

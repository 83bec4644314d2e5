//! The decode leg's pull: read the blocks a prefill engine holds (`POST
//! /sim/kv_transfer/read` on its side channel, which frees them all), then move the bytes of
//! those this engine does not cache over its inbound link (vLLM's NixlConnector reads only
//! the remote blocks past the decode engine's local prefix hit).

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};

use super::link::Link;
use super::params::RemotePrefill;
use crate::metrics::EngineMetrics;

/// The path of a prefill engine's read endpoint.
pub(crate) const READ_PATH: &str = "/sim/kv_transfer/read";

/// The body of a read.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ReadRequest {
    /// The prefill's request id (`remote_request_id`).
    pub request_id: Option<String>,
    /// The blocks it named (`remote_block_ids`).
    pub block_ids: Vec<u64>,
}

/// The answer to a read.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ReadAnswer {
    /// Blocks read (and freed there).
    pub blocks: usize,
}

/// Pulls prefills' KV into this engine.
#[derive(Debug)]
pub(crate) struct Puller {
    client: Client<HttpConnector, Full<Bytes>>,
    link: Arc<Link>,
    bytes_per_block: u64,
}

impl Puller {
    /// A puller moving `bytes_per_block` per block over `link`.
    pub(crate) fn new(link: Arc<Link>, bytes_per_block: u64) -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build_http(),
            link,
            bytes_per_block,
        }
    }

    /// Pulls `remote`'s blocks past the first `cached` (this engine holds those); how many
    /// the prompt now has (`None`: the read failed, and the request prefills here instead).
    pub(crate) async fn pull(
        &self,
        remote: &RemotePrefill,
        cached: usize,
        metrics: &EngineMetrics,
    ) -> Option<usize> {
        metrics.transfer_started();
        match self.read(remote).await {
            Ok(blocks) => {
                self.carry(blocks, cached, metrics).await;
                Some(blocks)
            }
            Err(error) => {
                tracing::warn!(remote = %remote.address, %error, "KV pull failed: prefilling locally");
                metrics.transfer_failed();
                None
            }
        }
    }

    /// Moves the bytes of `blocks` blocks past the first `cached` (this engine holds those)
    /// over the link, ending a transfer counted as started.
    pub(crate) async fn carry(&self, blocks: usize, cached: usize, metrics: &EngineMetrics) {
        let bytes = blocks.saturating_sub(cached) as u64 * self.bytes_per_block;
        let took = self.link.transfer(bytes).await;
        metrics.transfer_done(bytes, took.as_secs_f64());
    }

    async fn read(&self, remote: &RemotePrefill) -> Result<usize, String> {
        let read = ReadRequest {
            request_id: Some(remote.request_id.clone()),
            block_ids: remote.block_ids.clone(),
        };
        let (status, body) = self.post(&remote.address, READ_PATH, &read).await?;
        if status != StatusCode::OK {
            return Err(format!("{status}: {}", String::from_utf8_lossy(&body)));
        }
        let answer: ReadAnswer = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        Ok(answer.blocks)
    }

    /// POSTs `body` as JSON to `http://{address}{path}`; the answer's status and body.
    pub(crate) async fn post<T: Serialize>(
        &self,
        address: &str,
        path: &str,
        body: &T,
    ) -> Result<(StatusCode, Bytes), String> {
        let body = serde_json::to_vec(body).map_err(|e| e.to_string())?;
        let request = Request::builder()
            .method(Method::POST)
            .uri(format!("http://{address}{path}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, body))
    }
}

//! The engine's KV cache shape, read where its kind states it: its block size and how many
//! blocks its KV cache holds (read by [`kvmesh_wire::cache_config`]: vLLM's and
//! trtllm-serve's metrics pages, SGLang's `/get_server_info`). The agent checks its block
//! size against the engine's and puts the capacity in the instance record, so the proxy
//! measures the instance's load by it.

use std::time::Duration;

pub(crate) use kvmesh_wire::cache_config::CacheConfig;

use crate::config::EngineKind;
use crate::http_client::EngineClient;

/// One read of the engine's cache configuration; `None` when the engine did not state it.
pub(crate) async fn fetch(
    engine: &EngineClient,
    kind: EngineKind,
    timeout: Duration,
) -> Option<CacheConfig> {
    let path = match kind {
        EngineKind::Vllm | EngineKind::Trtllm => crate::load::metrics_path(kind),
        EngineKind::Sglang => "/get_server_info",
    };
    let body = match engine.get(path, timeout).await {
        Ok((status, body)) if status.is_success() => body,
        _ => return None,
    };
    match kind {
        EngineKind::Vllm => CacheConfig::from_vllm_metrics(std::str::from_utf8(&body).ok()?),
        EngineKind::Sglang => CacheConfig::from_sglang_info(&body),
        EngineKind::Trtllm => CacheConfig::from_trtllm_metrics(std::str::from_utf8(&body).ok()?),
    }
}

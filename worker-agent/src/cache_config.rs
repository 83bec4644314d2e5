//! The engine's KV cache shape, as the engine itself states it: its block size and how many
//! blocks its KV cache holds. vLLM publishes both as labels of `vllm:cache_config_info` on
//! `/metrics` (`block_size`, `num_gpu_blocks`); SGLang's `/get_server_info` has `page_size`
//! and `max_total_num_tokens`. The agent checks its block size against the engine's and
//! puts the capacity in the instance record, so the proxy measures the instance's load by it.

use std::time::Duration;

use crate::config::EngineKind;

use crate::http_client::EngineClient;
use crate::prom_text;

/// What the engine says about its KV cache (each `None` when it does not say).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CacheConfig {
    /// Tokens per KV block.
    pub(crate) block_size: Option<usize>,
    /// KV cache capacity in blocks.
    pub(crate) total_blocks: Option<u64>,
}

impl CacheConfig {
    /// From a vLLM `/metrics` page; `None` without `vllm:cache_config_info`.
    pub(crate) fn from_vllm_metrics(text: &str) -> Option<Self> {
        let labels = prom_text::labels(text, "vllm:cache_config_info")?;
        let value = |name: &str| {
            labels
                .iter()
                .find(|(label, _)| label == name)
                .and_then(|(_, value)| value.parse::<u64>().ok())
        };
        Some(Self {
            block_size: value("block_size").and_then(|size| usize::try_from(size).ok()),
            total_blocks: value("num_gpu_blocks"),
        })
    }

    /// From trtllm-serve's `/prometheus/metrics` page: `trtllm_kv_cache_tokens_per_block` and
    /// `trtllm_kv_cache_max_blocks` (set from its iteration stats, so present once the engine
    /// ran an iteration); `None` when neither is there.
    pub(crate) fn from_trtllm_metrics(text: &str) -> Option<Self> {
        let value = |name: &str| {
            prom_text::mean(text, name)
                .filter(|v| v.is_finite() && *v >= 1.0)
                .map(|v| v as u64)
        };
        let block_size = value("trtllm_kv_cache_tokens_per_block");
        let total_blocks = value("trtllm_kv_cache_max_blocks");
        (block_size.is_some() || total_blocks.is_some()).then(|| Self {
            block_size: block_size.and_then(|size| usize::try_from(size).ok()),
            total_blocks,
        })
    }

    /// From an SGLang `/get_server_info` body; `None` when it is not a JSON object.
    pub(crate) fn from_sglang_info(body: &[u8]) -> Option<Self> {
        let info: serde_json::Value = serde_json::from_slice(body).ok()?;
        let info = info.as_object()?;
        let number = |name: &str| info.get(name).and_then(serde_json::Value::as_u64);
        let page = number("page_size").filter(|&page| page > 0);
        Some(Self {
            block_size: page.and_then(|size| usize::try_from(size).ok()),
            total_blocks: number("max_total_num_tokens")
                .zip(page)
                .map(|(tokens, page)| tokens / page),
        })
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_states_it_in_cache_config_info() {
        let text = "# TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"27169\",num_cpu_blocks=\"None\"} 1.0\n";
        assert_eq!(
            CacheConfig::from_vllm_metrics(text),
            Some(CacheConfig {
                block_size: Some(16),
                total_blocks: Some(27_169),
            })
        );
        let unknown = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1.0\n";
        assert_eq!(
            CacheConfig::from_vllm_metrics(unknown).and_then(|c| c.total_blocks),
            None,
            "not profiled yet"
        );
        assert_eq!(
            CacheConfig::from_vllm_metrics("vllm:num_requests_running 1\n"),
            None
        );
    }

    #[test]
    fn sglang_states_it_in_its_server_info() {
        let body = br#"{"page_size": 64, "max_total_num_tokens": 640000, "other": 1}"#;
        assert_eq!(
            CacheConfig::from_sglang_info(body),
            Some(CacheConfig {
                block_size: Some(64),
                total_blocks: Some(10_000),
            })
        );
        assert_eq!(
            CacheConfig::from_sglang_info(br#"{"page_size": 0}"#),
            Some(CacheConfig::default())
        );
        assert_eq!(CacheConfig::from_sglang_info(b"[]"), None);
    }

    #[test]
    fn trtllm_states_it_in_its_kv_cache_gauges() {
        let page = "trtllm_kv_cache_max_blocks{engine_type=\"undefined\",model_name=\"undefined\"} 2048.0
            trtllm_kv_cache_tokens_per_block{engine_type=\"undefined\",model_name=\"undefined\"} 32.0
";
        assert_eq!(
            CacheConfig::from_trtllm_metrics(page),
            Some(CacheConfig {
                block_size: Some(32),
                total_blocks: Some(2048),
            })
        );
        assert_eq!(
            CacheConfig::from_trtllm_metrics("trtllm_num_requests_running 1\n"),
            None,
            "no iteration yet"
        );
    }
}

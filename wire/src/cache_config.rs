//! An engine's KV cache shape as the engine itself states it: its block size and how many
//! blocks its KV cache holds. vLLM publishes both as labels of `vllm:cache_config_info` on
//! `/metrics` (`block_size`, `num_gpu_blocks`); trtllm-serve as the gauges
//! `trtllm_kv_cache_tokens_per_block` and `trtllm_kv_cache_max_blocks` on
//! `/prometheus/metrics`; SGLang's `/get_server_info` has `page_size` and
//! `max_total_num_tokens`. The agent (kvmesh-agent) fetches them, checks its block size
//! against the engine's and puts the capacity in the instance record.

use crate::prom_text;

/// What an engine says about its KV cache: each `None` when it does not say, or says 0 (a
/// block size of 0 would translate nothing; a capacity of 0 is unknown to the proxy too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheConfig {
    /// Tokens per KV block, at least 1.
    pub block_size: Option<usize>,
    /// KV cache capacity in blocks, at least 1.
    pub total_blocks: Option<u64>,
}

impl CacheConfig {
    /// From a vLLM `/metrics` page: the labels of the first sample of
    /// `vllm:cache_config_info`, as whole numbers; `None` without such a sample.
    pub fn from_vllm_metrics(text: &str) -> Option<Self> {
        let labels = prom_text::labels(text, "vllm:cache_config_info")?;
        let value = |name: &str| {
            labels
                .iter()
                .find(|(label, _)| label == name)
                .and_then(|(_, value)| value.parse::<u64>().ok())
                .filter(|&value| value >= 1)
        };
        Some(Self {
            block_size: value("block_size").and_then(|size| usize::try_from(size).ok()),
            total_blocks: value("num_gpu_blocks"),
        })
    }

    /// From trtllm-serve's `/prometheus/metrics` page: `trtllm_kv_cache_tokens_per_block` (a
    /// whole number) and `trtllm_kv_cache_max_blocks` (rounded down), each the mean of its
    /// samples (set from its iteration stats, so present once the engine ran an iteration);
    /// `None` when neither is stated.
    pub fn from_trtllm_metrics(text: &str) -> Option<Self> {
        let block_size = prom_text::mean(text, "trtllm_kv_cache_tokens_per_block")
            .filter(|size| size.fract() == 0.0 && *size >= 1.0)
            .and_then(|size| usize::try_from(size as u64).ok());
        let total_blocks = prom_text::mean(text, "trtllm_kv_cache_max_blocks")
            .filter(|blocks| blocks.is_finite() && *blocks >= 1.0)
            .map(|blocks| blocks as u64);
        (block_size.is_some() || total_blocks.is_some()).then_some(Self {
            block_size,
            total_blocks,
        })
    }

    /// From an SGLang `/get_server_info` body: `page_size`, and `max_total_num_tokens` in
    /// whole pages; `None` when it is not a JSON object.
    pub fn from_sglang_info(body: &[u8]) -> Option<Self> {
        let info: serde_json::Value = serde_json::from_slice(body).ok()?;
        let info = info.as_object()?;
        let number = |name: &str| info.get(name).and_then(serde_json::Value::as_u64);
        let page = number("page_size").filter(|&page| page > 0);
        Some(Self {
            block_size: page.and_then(|size| usize::try_from(size).ok()),
            total_blocks: number("max_total_num_tokens")
                .zip(page)
                .map(|(tokens, page)| tokens / page)
                .filter(|&blocks| blocks >= 1),
        })
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
    fn zero_is_not_a_size() {
        // A block size of 0 went on to be the agent's block size.
        let zero = "vllm:cache_config_info{block_size=\"0\",num_gpu_blocks=\"0\"} 1.0\n";
        assert_eq!(
            CacheConfig::from_vllm_metrics(zero),
            Some(CacheConfig::default())
        );
        assert_eq!(
            CacheConfig::from_sglang_info(br#"{"page_size": 64, "max_total_num_tokens": 63}"#),
            Some(CacheConfig {
                block_size: Some(64),
                total_blocks: None,
            })
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
        let odd = "trtllm_kv_cache_tokens_per_block 32.5\ntrtllm_kv_cache_max_blocks 2048.5\n";
        assert_eq!(
            CacheConfig::from_trtllm_metrics(odd),
            Some(CacheConfig {
                block_size: None,
                total_blocks: Some(2048),
            })
        );
    }
}

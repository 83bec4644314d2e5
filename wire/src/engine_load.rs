//! An engine's load as its Prometheus `/metrics` states it: the requests it runs and the ones
//! it queues (summed over label sets: a data-parallel engine states one sample per rank) and
//! how full its KV cache is (averaged). Which metrics say so differs by engine: [`VLLM`],
//! [`SGLANG`] and [`TRTLLM`] name them.

use crate::prom_text;

/// The metrics an engine states its load in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadGauges<'a> {
    /// Requests being processed (vLLM: `vllm:num_requests_running`).
    pub running: &'a str,
    /// Requests queued (vLLM: `vllm:num_requests_waiting`).
    pub waiting: &'a str,
    /// KV cache usage from 0 to 1: the first of these that has a sample.
    pub kv_usage: &'a [&'a str],
}

/// vLLM's gauges (`vllm:gpu_cache_usage_perc`: its name for KV usage before V1).
pub const VLLM: LoadGauges<'static> = LoadGauges {
    running: "vllm:num_requests_running",
    waiting: "vllm:num_requests_waiting",
    kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
};

/// SGLang's gauges.
pub const SGLANG: LoadGauges<'static> = LoadGauges {
    running: "sglang:num_running_reqs",
    waiting: "sglang:num_queue_reqs",
    kv_usage: &["sglang:token_usage"],
};

/// trtllm-serve's gauges, on `/prometheus/metrics`: its `MetricsCollector`
/// (tensorrt_llm/metrics/collector.py, read at TensorRT-LLM commit 050f80de) sets them from
/// its iteration stats' `numActiveRequests`, `numQueuedRequests` and
/// `usedNumBlocks / maxNumBlocks`.
pub const TRTLLM: LoadGauges<'static> = LoadGauges {
    running: "trtllm_num_requests_running",
    waiting: "trtllm_num_requests_waiting",
    kv_usage: &["trtllm_kv_cache_utilization"],
};

/// What an engine's load gauges say.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineLoad {
    /// Requests being processed: the sum of the samples, rounded down (0 when negative).
    pub running: u64,
    /// Requests queued, the same way.
    pub waiting: u64,
    /// KV cache usage, from 0.0 to 1.0: the mean of the samples, brought into that range
    /// (0.0 when there is none, or it is not a number).
    pub kv_usage: f64,
}

/// Reads an engine's load off its exposition `text`; `None` when the running or the waiting
/// gauge has no sample, or its samples do not sum to a finite number (`NaN`, `+Inf`).
pub fn read_load(text: &str, gauges: &LoadGauges<'_>) -> Option<EngineLoad> {
    let count = |name: &str| {
        prom_text::sum(text, name)
            .filter(|sum| sum.is_finite())
            .map(|sum| sum.max(0.0) as u64)
    };
    let running = count(gauges.running)?;
    let waiting = count(gauges.waiting)?;
    let kv_usage = gauges
        .kv_usage
        .iter()
        .find_map(|name| prom_text::mean(text, name))
        .filter(|usage| !usage.is_nan())
        .map_or(0.0, |usage| usage.clamp(0.0, 1.0));
    Some(EngineLoad {
        running,
        waiting,
        kv_usage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_summed_and_usage_averaged() {
        let text = "vllm:num_requests_running{engine=\"0\"} 3\n\
            vllm:num_requests_running{engine=\"1\"} 2\n\
            vllm:num_requests_waiting{engine=\"0\"} 1.0\n\
            vllm:num_requests_waiting{engine=\"1\"} 0\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
            vllm:kv_cache_usage_perc{engine=\"1\"} 0.25\n\
            vllm:gpu_cache_usage_perc 0.9\n";
        assert_eq!(
            read_load(text, &VLLM),
            Some(EngineLoad {
                running: 5,
                waiting: 1,
                kv_usage: 0.375
            })
        );
        let old = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.4\n";
        assert_eq!(read_load(old, &VLLM).map(|load| load.kv_usage), Some(0.4));
        let bare = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n";
        assert_eq!(read_load(bare, &VLLM).map(|load| load.kv_usage), Some(0.0));
        assert_eq!(read_load("vllm:num_requests_running 1\n", &VLLM), None);
    }

    #[test]
    fn gauges_that_are_not_numbers_make_no_load() {
        let with = |running: &str, usage: &str| {
            read_load(
                &format!(
                    "vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\n\
                     vllm:kv_cache_usage_perc {usage}\n"
                ),
                &VLLM,
            )
        };
        assert_eq!(with("NaN", "0.5"), None);
        assert_eq!(with("+Inf", "0.5"), None);
        assert_eq!(with("-3", "0.5").map(|load| load.running), Some(0));
        assert_eq!(with("2.9", "0.5").map(|load| load.running), Some(2));
        // A NaN usage was kept: the load report's JSON then carried `null`, which the proxy
        // does not read.
        assert_eq!(with("1", "NaN").map(|load| load.kv_usage), Some(0.0));
        assert_eq!(with("1", "+Inf").map(|load| load.kv_usage), Some(1.0));
        assert_eq!(with("1", "-0.5").map(|load| load.kv_usage), Some(0.0));
        let opposite = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} +Inf\n\
            vllm:kv_cache_usage_perc{engine=\"1\"} -Inf\n";
        assert_eq!(
            read_load(opposite, &VLLM).map(|load| load.kv_usage),
            Some(0.0)
        );
    }
}

//! Read-only endpoints: models, health, metrics, server and model info; the cache reset.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use serde_json::json;

use super::body::{ResponseBody, bytes_response, empty_response, json_response};
use super::error::ApiError;
use super::state::EngineState;
use crate::config::DisaggregationMode;
use crate::metrics::EngineMetrics;

/// `GET /v1/models`: the served model, then every loaded LoRA adapter in load order the way
/// vLLM lists them (`root` the adapter's path, `parent` the served model, no `max_model_len`).
pub(crate) fn models(state: &EngineState) -> Response<ResponseBody> {
    let model = &state.config.model;
    let mut data = vec![json!({
        "id": model,
        "object": "model",
        "created": state.started,
        "owned_by": "vllm",
        "root": model,
        "parent": null,
        "max_model_len": state.config.max_model_len,
    })];
    data.extend(state.loras.list().into_iter().map(|adapter| {
        json!({
            "id": &*adapter.lora.name,
            "object": "model",
            "created": state.started,
            "owned_by": "vllm",
            "root": adapter.path,
            "parent": model,
            "max_model_len": null,
        })
    }));
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

/// `GET /sim/traceparents` (test hook): `{"traceparents": [...]}`, the `traceparent` of the
/// last 64 generation requests that had one, oldest first.
pub(crate) fn traceparents(state: &EngineState) -> Response<ResponseBody> {
    json_response(
        StatusCode::OK,
        &json!({ "traceparents": state.traceparents() }),
    )
}

/// `GET /health` and friends: 200 with an empty body.
pub(crate) fn health() -> Response<ResponseBody> {
    empty_response(StatusCode::OK)
}

/// `GET /metrics`.
pub(crate) fn metrics(state: &EngineState) -> Response<ResponseBody> {
    bytes_response(
        StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        Bytes::from(EngineMetrics::render_ranks(
            &state.ranks.iter().map(|r| &*r.metrics).collect::<Vec<_>>(),
        )),
    )
}

/// Directory of the configured tokenizer: reported as model and tokenizer path. Without a
/// configured tokenizer nothing is reported (routers would try to download it).
fn tokenizer_dir(state: &EngineState) -> Option<String> {
    let path = state.config.tokenizer.as_ref()?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(path);
    Some(dir.display().to_string())
}

/// `GET /get_server_info` and `/server_info` (SGLang shape, simulator fields added).
pub(crate) fn server_info(state: &EngineState) -> Response<ResponseBody> {
    let c = &state.config;
    let mut info = json!({
        "served_model_name": c.model,
        "context_length": c.max_model_len,
        "max_model_len": c.max_model_len,
        "page_size": c.block_size,
        "block_size": c.block_size,
        "num_gpu_blocks": c.num_gpu_blocks,
        "max_total_num_tokens": c.num_gpu_blocks.saturating_mul(c.block_size),
        "max_running_requests": c.max_num_seqs,
        "max_num_seqs": c.max_num_seqs,
        "chunked_prefill_size": c.max_num_batched_tokens,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "enable_prefix_caching": c.enable_prefix_caching,
        "disable_radix_cache": !c.enable_prefix_caching,
        "dp_size": state.ranks.len(),
        "tp_size": 1,
        "is_generation": true,
        "worker": state.addr,
        "engine": "kvmesh-engine-sim",
        "version": env!("CARGO_PKG_VERSION"),
    });
    if let Some(dir) = tokenizer_dir(state) {
        info["model_path"] = json!(dir);
        info["tokenizer_path"] = json!(dir);
    }
    // SGLang's server arguments of its disaggregation (a prefill engine's port is the one its
    // bootstrap server got), where a router reads the bootstrap port.
    let sglang = &c.kv_transfer.sglang;
    if sglang.mode != DisaggregationMode::Null {
        info["disaggregation_mode"] = json!(sglang.mode.as_str());
        info["disaggregation_bootstrap_port"] = json!(sglang.bootstrap_port);
    }
    json_response(StatusCode::OK, &info)
}

/// `GET /get_model_info` and `/model_info`.
pub(crate) fn model_info(state: &EngineState) -> Response<ResponseBody> {
    let mut info = json!({
        "served_model_name": state.config.model,
        "is_generation": true,
        "max_model_len": state.config.max_model_len,
        "block_size": state.config.block_size,
    });
    if let Some(dir) = tokenizer_dir(state) {
        info["model_path"] = json!(dir);
        info["tokenizer_path"] = json!(dir);
    }
    json_response(StatusCode::OK, &info)
}

/// `POST /reset_prefix_cache`: every data-parallel rank's cache, as vLLM resets them all.
pub(crate) async fn reset_prefix_cache(state: Arc<EngineState>) -> Response<ResponseBody> {
    for rank in &state.ranks {
        if let Err(e) = rank.scheduler.reset_prefix_cache(false).await {
            return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response();
        }
    }
    empty_response(StatusCode::OK)
}

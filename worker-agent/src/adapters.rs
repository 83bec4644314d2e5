//! The LoRA adapters the engine serves, read from its `GET /v1/models` (at start and at every
//! health interval, [`crate::engine_facts`]: vLLM loads and unloads adapters at run time):
//! the list goes into the instance record, so the proxy sends a request naming an adapter
//! only to instances that serve it.
//!
//! vLLM and SGLang list an adapter as a model whose `parent` is the base model; the base
//! model's own entry has no `parent` (null). A page that cannot be read or parsed changes
//! nothing: the last known list stays advertised.

use std::time::Duration;

use serde::Deserialize;

use crate::http_client::EngineClient;

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

/// The adapters a `GET /v1/models` body lists (sorted, without duplicates); `None` when it is
/// not a model list.
pub(crate) fn parse(body: &[u8]) -> Option<Vec<String>> {
    let list: ModelList = serde_json::from_slice(body).ok()?;
    let mut adapters: Vec<String> = list
        .data
        .into_iter()
        .filter(|entry| entry.parent.as_deref().is_some_and(|p| !p.is_empty()))
        .map(|entry| entry.id)
        .filter(|id| !id.is_empty())
        .collect();
    adapters.sort_unstable();
    adapters.dedup();
    Some(adapters)
}

/// One read of the engine's adapters; `None` when the engine did not answer with a model list.
pub(crate) async fn fetch(engine: &EngineClient, timeout: Duration) -> Option<Vec<String>> {
    match engine.get("/v1/models", timeout).await {
        Ok((status, body)) if status.is_success() => parse(&body),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_are_the_entries_with_a_parent() {
        let body = br#"{"object":"list","data":[
            {"id":"Qwen/Qwen3-8B","object":"model","root":"Qwen/Qwen3-8B","parent":null},
            {"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"Qwen/Qwen3-8B"},
            {"id":"chat-lora","object":"model","root":"/adapters/chat","parent":"Qwen/Qwen3-8B"},
            {"id":"chat-lora","object":"model","parent":"Qwen/Qwen3-8B"},
            {"id":"other","object":"model"}
        ]}"#;
        assert_eq!(
            parse(body),
            Some(vec!["chat-lora".into(), "sql-lora".into()])
        );
    }

    #[test]
    fn a_list_without_adapters_is_empty_and_garbage_is_none() {
        let body = br#"{"object":"list","data":[{"id":"m","parent":null}]}"#;
        assert_eq!(parse(body), Some(Vec::new()));
        assert_eq!(parse(b"not json"), None);
        assert_eq!(parse(br#"{"data":"x"}"#), None);
    }
}

//! vLLM's protocol beyond the OpenAI API:
//!
//! - **Disaggregated serving**, as its own disaggregation proxy speaks it: the prefill leg
//!   is the request with one output token, no stream and `kv_transfer_params` asking for a
//!   remote decode; the prefill engine's answer carries the `kv_transfer_params` the decode
//!   engine pulls the KV with, put into the decode leg.
//! - **Continuing a chat**: a migrated stream's text so far as the assistant's final message,
//!   with `continue_final_message: true` and `add_generation_prompt: false` (SGLang reads the
//!   same fields).

use bytes::Bytes;
use serde_json::{Map, Value, json};

/// The prefill leg of the client's `request`.
pub(crate) fn prefill_leg(request: &Map<String, Value>) -> Result<Bytes, String> {
    serde_json::to_vec(&prefill_request(request))
        .map(Bytes::from)
        .map_err(|error| error.to_string())
}

/// The prefill leg of `request`, as a JSON object.
fn prefill_request(request: &Map<String, Value>) -> Map<String, Value> {
    let mut leg = request.clone();
    leg.insert(
        "kv_transfer_params".to_string(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    leg.insert("stream".to_string(), Value::Bool(false));
    leg.insert("max_tokens".to_string(), json!(1));
    if leg.contains_key("max_completion_tokens") {
        leg.insert("max_completion_tokens".to_string(), json!(1));
    }
    for field in ["stream_options", "min_tokens", "min_completion_tokens"] {
        leg.remove(field);
    }
    leg
}

/// The decode leg: `request` with the `kv_transfer_params` of the prefill engine's
/// `answer`.
pub(crate) fn decode_leg(mut request: Map<String, Value>, answer: &[u8]) -> Result<Bytes, String> {
    let mut answer: Map<String, Value> = serde_json::from_slice(answer)
        .map_err(|error| format!("the answer is not JSON: {error}"))?;
    let params = match answer.remove("kv_transfer_params") {
        Some(params @ Value::Object(_)) => params,
        _ => {
            return Err(
                "the answer carries no kv_transfer_params (is the engine started \
                        with a KV connector?)"
                    .to_string(),
            );
        }
    };
    request.insert("kv_transfer_params".to_string(), params);
    serde_json::to_vec(&request)
        .map(Bytes::from)
        .map_err(|error| error.to_string())
}

/// The chat `request` continuing `text` as the assistant's final message (appended to one
/// the client already asked to continue).
pub(crate) fn continue_chat(request: &mut Map<String, Value>, text: &str) {
    let continuing = request.get("continue_final_message") == Some(&Value::Bool(true));
    if let Some(Value::Array(messages)) = request.get_mut("messages") {
        let last = messages.last_mut().filter(|_| continuing);
        match last.and_then(|m| m.get_mut("content")) {
            Some(Value::String(content)) => content.push_str(text),
            _ => messages.push(json!({"role": "assistant", "content": text})),
        }
    }
    request.insert("continue_final_message".into(), Value::Bool(true));
    request.insert("add_generation_prompt".into(), Value::Bool(false));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_leg_is_the_request_with_one_token_no_stream_and_the_params() {
        let request: Map<String, Value> = serde_json::from_str(
            r#"{"model":"m","prompt":"hi","max_tokens":50,"stream":true,
                "stream_options":{"include_usage":true},"min_tokens":4,"temperature":0.5}"#,
        )
        .unwrap();
        let leg = prefill_request(&request);
        assert_eq!(leg["max_tokens"], 1);
        assert_eq!(leg["stream"], false);
        assert_eq!(leg["temperature"], 0.5);
        assert_eq!(leg["prompt"], "hi");
        for gone in ["stream_options", "min_tokens", "min_completion_tokens"] {
            assert!(!leg.contains_key(gone), "{gone}");
        }
        assert!(!leg.contains_key("max_completion_tokens"));
        assert_eq!(
            leg["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false,
                   "remote_engine_id": null, "remote_block_ids": null,
                   "remote_host": null, "remote_port": null})
        );
        let chat: Map<String, Value> =
            serde_json::from_str(r#"{"model":"m","messages":[],"max_completion_tokens":9}"#)
                .unwrap();
        assert_eq!(prefill_request(&chat)["max_completion_tokens"], 1);
    }

    #[test]
    fn the_decode_leg_carries_the_prefill_engines_params() {
        let request: Map<String, Value> =
            serde_json::from_str(r#"{"model":"m","prompt":"hi","stream":true}"#).unwrap();
        let answer = br#"{"choices":[],"kv_transfer_params":{"remote_engine_id":"e1","remote_block_ids":[1,2]}}"#;
        let leg: Value =
            serde_json::from_slice(&decode_leg(request.clone(), answer).unwrap()).unwrap();
        assert_eq!(leg["stream"], true);
        assert_eq!(leg["kv_transfer_params"]["remote_engine_id"], "e1");
        let missing = decode_leg(request.clone(), br#"{"choices":[]}"#).unwrap_err();
        assert!(missing.contains("no kv_transfer_params"), "{missing}");
        assert!(
            decode_leg(request, b"not json")
                .unwrap_err()
                .contains("not JSON")
        );
    }
}

//! Qwen3's chat template, rendered without the template engine for the conversations it
//! renders plainly.
//!
//! Rendering a short chat through minijinja costs about 35,000 instructions, most of a
//! `policy: kv` request's cost in the overhead benchmark. Qwen3's template (its
//! `tokenizer_config.json`'s `chat_template`, recognised by its SHA-256) is rendered here
//! directly when the request has no `tools`, every message is a `system`, `user` or
//! `assistant` message with string content and no `reasoning`, `reasoning_content` or
//! `tool_calls`, and `chat_template_kwargs` holds at most `enable_thinking`; every other
//! request (and every other template) goes through minijinja as before.
//!
//! What the template does with such a conversation, step by step:
//! - a first `system` message opens the prompt; later ones render like user turns;
//! - the last user message that is not a `<tool_response>…</tool_response>` is the query;
//! - an assistant message whose content holds `</think>` is split into reasoning (after the
//!   last `<think>` before the first `</think>`) and content (after the last `</think>`);
//!   after the query, the last message and every message with reasoning render it in a
//!   `<think>` block;
//! - the generation prompt, with an empty `<think>` block when `enable_thinking` is `false`.
//!
//! Held to minijinja's rendering of the same template by a property test over generated
//! conversations, and to Hugging Face `transformers` by the ground-truth fixtures
//! (`tests/qwen3_ground_truth.rs`).

use minijinja::value::ValueKind;
use sha2::{Digest, Sha256};

use crate::request::{ChatMessage, ChatRequest, MessageContent};

/// SHA-256 of Qwen3's chat template (Qwen3 0.6B–235B, as `scripts/fetch-tokenizer.sh`
/// fetches it).
const QWEN3_TEMPLATE_SHA256: [u8; 32] = [
    0x87, 0xa2, 0x72, 0x8c, 0xb8, 0xdc, 0x9f, 0xe4, 0x24, 0xd6, 0x24, 0x54, 0x2f, 0x60, 0x60, 0xec,
    0x05, 0xa1, 0xd2, 0x85, 0xeb, 0xbe, 0xc5, 0x78, 0xbb, 0x07, 0x89, 0x00, 0xe3, 0x33, 0x96, 0xb5,
];

/// Whether `source` is Qwen3's chat template.
pub(crate) fn is_qwen3(source: &str) -> bool {
    Sha256::digest(source.as_bytes()).as_slice() == QWEN3_TEMPLATE_SHA256
}

/// `request` rendered as Qwen3's template renders it (string content), or `None` when it
/// is not one this module renders (minijinja then does).
pub(crate) fn render(request: &ChatRequest<'_>) -> Option<String> {
    let messages = &request.messages;
    if messages.is_empty() || request.tools.is_some() {
        return None;
    }
    let thinking_off = thinking_off(request)?;
    let mut texts = Vec::with_capacity(messages.len());
    for message in messages {
        texts.push(plain_text(message)?);
    }
    let mut out = String::with_capacity(texts.iter().map(|t| t.len() + 32).sum::<usize>() + 64);
    let open = |out: &mut String, role: &str| {
        out.push_str("<|im_start|>");
        out.push_str(role);
        out.push('\n');
    };
    if messages[0].role == "system" {
        open(&mut out, "system");
        out.push_str(texts[0]);
        out.push_str("<|im_end|>\n");
    }
    let query = messages
        .iter()
        .zip(&texts)
        .rposition(|(message, text)| {
            message.role == "user"
                && !(text.starts_with("<tool_response>") && text.ends_with("</tool_response>"))
        })
        .unwrap_or(messages.len() - 1);
    let last = messages.len() - 1;
    for (at, (message, text)) in messages.iter().zip(&texts).enumerate() {
        match (message.role.as_ref(), at) {
            ("user", _) | ("system", 1..) => {
                open(&mut out, &message.role);
                out.push_str(text);
                out.push_str("<|im_end|>\n");
            }
            ("assistant", _) => {
                let (content, reasoning) = split_reasoning(text);
                open(&mut out, "assistant");
                if at > query && (at == last || !reasoning.is_empty()) {
                    out.push_str("<think>\n");
                    out.push_str(reasoning.trim_matches('\n'));
                    out.push_str("\n</think>\n\n");
                    out.push_str(content.trim_start_matches('\n'));
                } else {
                    out.push_str(content);
                }
                out.push_str("<|im_end|>\n");
            }
            _ => {}
        }
    }
    if request.add_generation_prompt.unwrap_or(true) {
        open(&mut out, "assistant");
        if thinking_off {
            out.push_str("<think>\n\n</think>\n\n");
        }
    }
    Some(out)
}

/// Whether `chat_template_kwargs` sets `enable_thinking` to `false`; `None` when it holds
/// anything else.
fn thinking_off(request: &ChatRequest<'_>) -> Option<bool> {
    let Some(kwargs) = request
        .chat_template_kwargs
        .as_ref()
        .filter(|k| !k.is_none())
    else {
        return Some(false);
    };
    if kwargs.kind() != ValueKind::Map {
        return None;
    }
    let mut off = false;
    for key in kwargs.try_iter().ok()? {
        if key.as_str() != Some("enable_thinking") {
            return None;
        }
        let value = kwargs.get_item(&key).ok()?;
        off = value.kind() == ValueKind::Bool && !value.is_true();
    }
    Some(off)
}

/// The content of a message the template renders plainly, or `None`.
fn plain_text<'m>(message: &'m ChatMessage<'_>) -> Option<&'m str> {
    let plain = matches!(message.role.as_ref(), "system" | "user" | "assistant")
        && message.reasoning.is_none()
        && message.reasoning_content.is_none()
        && message
            .tool_calls
            .as_ref()
            .is_none_or(|calls| calls.is_none());
    match &message.content {
        Some(MessageContent::Text(text)) if plain => Some(text),
        _ => None,
    }
}

/// An assistant message's content and reasoning, split at `</think>` as the template does.
fn split_reasoning(text: &str) -> (&str, &str) {
    if !text.contains("</think>") {
        return (text, "");
    }
    let content = text
        .rsplit("</think>")
        .next()
        .unwrap_or("")
        .trim_start_matches('\n');
    let before = text
        .split("</think>")
        .next()
        .unwrap_or("")
        .trim_end_matches('\n');
    let reasoning = before
        .rsplit("<think>")
        .next()
        .unwrap_or("")
        .trim_start_matches('\n');
    (content, reasoning)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;
    use crate::ModelPreprocessor;

    fn model() -> &'static ModelPreprocessor {
        static MODEL: OnceLock<ModelPreprocessor> = OnceLock::new();
        MODEL.get_or_init(|| {
            let dir = match std::env::var_os("KVMESH_QWEN3_TOKENIZER") {
                Some(dir) => PathBuf::from(dir),
                None => {
                    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3")
                }
            };
            ModelPreprocessor::from_dir(&dir).unwrap_or_else(|e| {
                panic!("{}: {e} (run scripts/fetch-tokenizer.sh)", dir.display())
            })
        })
    }

    /// Both renderings of `body`: natively (`None`: not one it renders) and by minijinja.
    fn both(body: &Value) -> (Option<String>, String) {
        let text = body.to_string();
        let request = ChatRequest::from_slice(text.as_bytes()).unwrap();
        let native = render(&request);
        let engine = model().render_chat_with_template_engine(&request).unwrap();
        (native, engine)
    }

    #[test]
    fn the_fetched_qwen3_template_is_recognised() {
        assert!(model().qwen3_template);
        assert!(!is_qwen3("{{ messages }}"));
    }

    #[test]
    fn requests_beyond_plain_conversations_go_to_the_template_engine() {
        let user = json!({"role": "user", "content": "hi"});
        for body in [
            json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "f"}}]}),
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            json!({"messages": [{"role": "assistant", "content": "x", "reasoning_content": "r"}]}),
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": []}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
            json!({"messages": [user], "chat_template_kwargs": {"other": 1}}),
            json!({"messages": []}),
        ] {
            let text = body.to_string();
            let request = ChatRequest::from_slice(text.as_bytes()).unwrap();
            assert_eq!(render(&request), None, "{body}");
        }
    }

    /// Text built from the pieces the template treats specially.
    fn text() -> impl Strategy<Value = String> {
        let piece = prop::sample::select(vec![
            "a",
            "b c",
            "\n",
            "\n\n",
            " ",
            "<think>",
            "</think>",
            "<tool_response>",
            "</tool_response>",
            "é",
            "<|im_end|>",
        ]);
        prop::collection::vec(piece, 0..8).prop_map(|pieces| pieces.concat())
    }

    fn message() -> impl Strategy<Value = Value> {
        let role = prop::sample::select(vec!["system", "user", "assistant"]);
        (role, text()).prop_map(|(role, content)| json!({"role": role, "content": content}))
    }

    fn body() -> impl Strategy<Value = Value> {
        let generation = prop::option::of(any::<bool>());
        let thinking = prop::sample::select(vec![
            Value::Null,
            json!({}),
            json!({"enable_thinking": true}),
            json!({"enable_thinking": false}),
            json!({"enable_thinking": "false"}),
            json!({"enable_thinking": 0}),
        ]);
        (prop::collection::vec(message(), 1..7), generation, thinking).prop_map(
            |(messages, generation, kwargs)| {
                let mut body = json!({"model": "m", "messages": messages});
                if let Some(generation) = generation {
                    body["add_generation_prompt"] = json!(generation);
                }
                if !kwargs.is_null() {
                    body["chat_template_kwargs"] = kwargs;
                }
                body
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn plain_conversations_render_as_the_template_engine_renders_them(body in body()) {
            let (native, engine) = both(&body);
            prop_assert_eq!(native.as_deref(), Some(engine.as_str()), "{}", body);
        }
    }
}

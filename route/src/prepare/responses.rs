//! A `/v1/responses` body as the chat request vLLM renders it (its `construct_input_messages`):
//! `instructions` as a system message, a string `input` as a user message, a list `input`'s
//! message items as messages (their text parts as text parts), function tools as chat tools.
//! A request vLLM would prepend history to (`previous_response_id`, `conversation`) or with
//! items other than messages (tool calls, reasoning) is not converted: it is routed by load.

use serde_json::{Map, Value, json};

/// The chat body (`messages`, `tools`, `cache_salt`) for the responses body `body`, or
/// `None` when it cannot be rendered as vLLM would.
pub(crate) fn responses_as_chat(body: &[u8]) -> Option<Vec<u8>> {
    let request: Map<String, Value> = serde_json::from_slice(body).ok()?;
    if ["previous_response_id", "conversation"]
        .iter()
        .any(|history| request.get(*history).is_some_and(|v| !v.is_null()))
    {
        return None;
    }
    let mut messages = Vec::new();
    if let Some(instructions) = request.get("instructions").and_then(Value::as_str)
        && !instructions.is_empty()
    {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match request.get("input")? {
        Value::String(text) => messages.push(json!({"role": "user", "content": text})),
        Value::Array(items) => {
            for item in items {
                messages.push(message(item)?);
            }
        }
        _ => return None,
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(Value::Array(tools)) = request.get("tools") {
        let tools = tools.iter().map(tool).collect::<Option<Vec<_>>>()?;
        if !tools.is_empty() {
            chat.insert("tools".into(), Value::Array(tools));
        }
    }
    if let Some(salt) = request.get("cache_salt") {
        chat.insert("cache_salt".into(), salt.clone());
    }
    serde_json::to_vec(&Value::Object(chat)).ok()
}

/// A message item (`{"role", "content"}`, `type` absent or `message`) as a chat message.
fn message(item: &Value) -> Option<Value> {
    let item = item.as_object()?;
    if item.get("type").is_some_and(|kind| kind != "message") {
        return None;
    }
    let role = item.get("role")?.as_str()?;
    let content = match item.get("content")? {
        Value::String(text) => Value::String(text.clone()),
        Value::Array(parts) => Value::Array(parts.iter().map(text_part).collect::<Option<_>>()?),
        _ => return None,
    };
    Some(json!({"role": role, "content": content}))
}

/// A text part (`input_text`, `output_text`, `text`) as a chat text part.
fn text_part(part: &Value) -> Option<Value> {
    let kind = part.get("type")?.as_str()?;
    if !matches!(kind, "input_text" | "output_text" | "text") {
        return None;
    }
    Some(json!({"type": "text", "text": part.get("text")?.as_str()?}))
}

/// A responses function tool (`{"type":"function","name",…}`) as a chat tool.
fn tool(tool: &Value) -> Option<Value> {
    if tool.get("type")?.as_str()? != "function" {
        return None;
    }
    let mut function = Map::new();
    for field in ["name", "description", "parameters"] {
        if let Some(value) = tool.get(field) {
            function.insert(field.into(), value.clone());
        }
    }
    Some(json!({"type": "function", "function": function}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Option<Value> {
        responses_as_chat(body.to_string().as_bytes())
            .map(|bytes| serde_json::from_slice(&bytes).unwrap())
    }

    #[test]
    fn instructions_and_a_string_input_are_a_system_and_a_user_message() {
        let converted = chat(json!({"model": "m", "instructions": "Be brief.", "input": "Hi"}));
        assert_eq!(
            converted.unwrap(),
            json!({"messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"}
            ]})
        );
    }

    #[test]
    fn message_items_keep_their_roles_and_text_parts() {
        let body = json!({
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
                {"role": "user", "content": "c"}
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "cache_salt": "t"
        });
        assert_eq!(
            chat(body).unwrap(),
            json!({
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
                    {"role": "user", "content": "c"}
                ],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "cache_salt": "t"
            })
        );
    }

    #[test]
    fn history_and_other_items_are_not_converted() {
        assert_eq!(
            chat(json!({"input": "x", "previous_response_id": "resp_1"})),
            None
        );
        let call = json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]});
        assert_eq!(chat(call), None);
        let image = json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]});
        assert_eq!(chat(image), None);
        assert_eq!(chat(json!({"model": "m"})), None);
        assert_eq!(responses_as_chat(b"not json"), None);
    }
}

//! Turns a [`ChatRequest`] into the values a chat template sees, the way vLLM and Hugging Face
//! `transformers` prepare them.
//!
//! vLLM (`parse_chat_messages`): each message keeps only `role`, `content`, `tool_calls`,
//! `reasoning` / `reasoning_content` (assistant), `tool_call_id` (tool) and `name`; content is
//! normalised to the template's [`ContentFormat`]; tool-call `arguments` JSON strings are parsed
//! into objects. Tools are dumped as `{"type", "function": {"name", "description",
//! "parameters", ...}}` with absent optional fields as `null`.
//! transformers 5 (`apply_chat_template`): `None`-valued keys are dropped and reasoning is also
//! offered as `thinking` (first key) and `reasoning_content`.

use minijinja::Value;
use minijinja::value::ValueKind;

use crate::content_format::ContentFormat;
use crate::error::{PreprocessError, Result};
use crate::request::{ChatMessage, ContentPart, MessageContent, TypedPart};

/// The template inputs of one request (besides the special tokens, which are per model).
pub(crate) struct Conversation {
    pub(crate) messages: Value,
    pub(crate) tools: Value,
    pub(crate) add_generation_prompt: bool,
    /// `chat_template_kwargs` entries, in request order.
    pub(crate) kwargs: Vec<(String, Value)>,
}

impl Conversation {
    /// Prepares a request for rendering with content in `format`.
    pub(crate) fn from_request(
        request: &crate::ChatRequest<'_>,
        format: ContentFormat,
    ) -> Result<Self> {
        if request.messages.is_empty() {
            return Err(PreprocessError::InvalidRequest(
                "cannot apply a chat template to an empty conversation".into(),
            ));
        }
        let messages = request
            .messages
            .iter()
            .map(|m| message_value(m, format))
            .collect::<Result<Vec<_>>>()?;
        let tools = match &request.tools {
            None => Value::from(()),
            Some(tools) => tools
                .iter()
                .map(tool_value)
                .collect::<Result<Vec<_>>>()?
                .into(),
        };
        Ok(Self {
            messages: Value::from(messages),
            tools,
            add_generation_prompt: request.add_generation_prompt.unwrap_or(true),
            kwargs: template_kwargs(request.chat_template_kwargs.as_ref())?,
        })
    }
}

fn invalid(message: impl Into<String>) -> PreprocessError {
    PreprocessError::InvalidRequest(message.into())
}

/// The text of one typed part, or `None` for a text-like part without text (vLLM skips those).
fn typed_part_text<'p>(part: &'p TypedPart<'_>) -> Result<Option<&'p str>> {
    let Some(kind) = &part.kind else {
        if part.has_media() {
            return Err(PreprocessError::UnsupportedContent(
                "media content part".into(),
            ));
        }
        return Err(invalid("missing 'type' field in content part"));
    };
    let text = match kind.as_str() {
        "text" | "input_text" | "output_text" => &part.text,
        "refusal" => &part.refusal,
        "thinking" => &part.thinking,
        "image_url" | "input_image" | "image_embeds" | "image_pil" | "audio_url"
        | "input_audio" | "audio_embeds" | "video_url" => {
            return Err(PreprocessError::UnsupportedContent(format!(
                "content part of type '{}'",
                kind.as_str()
            )));
        }
        other => return Err(invalid(format!("unknown content part type '{other}'"))),
    };
    Ok(text.as_ref().map(|t| t.as_str()))
}

/// The texts of a content list, in order.
fn part_texts<'p>(parts: &'p [ContentPart<'_>]) -> Result<Vec<&'p str>> {
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        match part {
            ContentPart::Text(t) => texts.push(t.as_ref()),
            ContentPart::Typed(p) => texts.extend(typed_part_text(p)?),
        }
    }
    Ok(texts)
}

fn content_value(content: Option<&MessageContent<'_>>, format: ContentFormat) -> Result<Value> {
    let texts: Vec<&str> = match content {
        None => Vec::new(),
        Some(MessageContent::Text(t)) => vec![t.as_ref()],
        Some(MessageContent::Parts(parts)) => part_texts(parts)?,
    };
    Ok(match format {
        ContentFormat::String => match texts.as_slice() {
            [one] => Value::from(*one),
            _ => Value::from(texts.join("\n")),
        },
        ContentFormat::OpenAi => texts
            .into_iter()
            .map(|t| Value::from_pairs([("type", Value::from("text")), ("text", Value::from(t))]))
            .collect::<Vec<_>>()
            .into(),
    })
}

fn message_value(message: &ChatMessage<'_>, format: ContentFormat) -> Result<Value> {
    let role = message.role.as_ref();
    let mut fields: Vec<(&str, Value)> = Vec::with_capacity(8);
    fields.push(("role", Value::from(role)));
    fields.push(("content", content_value(message.content.as_ref(), format)?));
    let mut reasoning = None;
    match role {
        "assistant" => {
            if let Some(calls) = message.tool_calls.as_ref().filter(|c| !c.is_none()) {
                fields.push(("tool_calls", tool_calls_value(calls)?));
            }
            // vLLM: `message.get("reasoning") or message.get("reasoning_content")`.
            reasoning = [&message.reasoning, &message.reasoning_content]
                .into_iter()
                .flatten()
                .map(|r| r.as_str())
                .find(|r| !r.is_empty())
                .or_else(|| message.reasoning_content.as_ref().map(|r| r.as_str()));
            if let Some(r) = reasoning {
                fields.push(("reasoning", Value::from(r)));
                fields.push(("reasoning_content", Value::from(r)));
            }
        }
        "tool" => {
            if let Some(id) = &message.tool_call_id {
                fields.push(("tool_call_id", Value::from(id.as_str())));
            }
        }
        _ => {}
    }
    if let Some(name) = &message.name {
        fields.push(("name", Value::from(name.as_str())));
    }
    if let Some(r) = reasoning {
        fields.insert(0, ("thinking", Value::from(r)));
    }
    Ok(Value::from_pairs(fields))
}

/// Copies `map`'s entries in order, replacing the value of `key` (appended when absent).
fn map_with(map: &Value, key: &str, value: Value) -> Result<Value> {
    let mut entries = Vec::new();
    let mut replaced = false;
    for k in map.try_iter().map_err(|e| invalid(e.to_string()))? {
        let v = if k.as_str() == Some(key) {
            replaced = true;
            value.clone()
        } else {
            map.get_item(&k).map_err(|e| invalid(e.to_string()))?
        };
        entries.push((k, v));
    }
    if !replaced {
        entries.push((Value::from(key), value));
    }
    Ok(Value::from_pairs(entries))
}

/// vLLM `_postprocess_messages`: each call's `function.arguments` JSON string becomes an object;
/// a missing or empty one becomes `{}`.
fn tool_calls_value(calls: &Value) -> Result<Value> {
    if calls.kind() != ValueKind::Seq {
        return Err(invalid("tool_calls must be a list"));
    }
    let mut out = Vec::new();
    for call in calls.try_iter().map_err(|e| invalid(e.to_string()))? {
        let function = call
            .get_attr("function")
            .ok()
            .filter(|f| f.kind() == ValueKind::Map)
            .ok_or_else(|| invalid("each tool call needs a 'function' object"))?;
        let arguments = function.get_attr("arguments").unwrap_or(Value::UNDEFINED);
        let parsed = if !arguments.is_true() {
            Value::from_pairs(Vec::<(Value, Value)>::new())
        } else if matches!(arguments.kind(), ValueKind::Map | ValueKind::Seq) {
            arguments
        } else if let Some(text) = arguments.as_str() {
            serde_json::from_str::<Value>(text)
                .map_err(|e| invalid(format!("tool call arguments are not valid JSON: {e}")))?
        } else {
            return Err(invalid("tool call arguments must be a JSON string"));
        };
        let function = map_with(&function, "arguments", parsed)?;
        out.push(map_with(&call, "function", function)?);
    }
    Ok(Value::from(out))
}

/// vLLM `ChatCompletionToolsParam.model_dump()`.
fn tool_value(tool: &Value) -> Result<Value> {
    let function = tool
        .get_attr("function")
        .ok()
        .filter(|f| f.kind() == ValueKind::Map)
        .ok_or_else(|| invalid("each tool needs a 'function' object"))?;
    let name = function.get_attr("name").unwrap_or(Value::UNDEFINED);
    if name.as_str().is_none() {
        return Err(invalid("each tool function needs a string 'name'"));
    }
    let optional = |key: &str| {
        let v = function.get_attr(key).unwrap_or(Value::UNDEFINED);
        if v.is_undefined() { Value::from(()) } else { v }
    };
    let mut fields = vec![
        (Value::from("name"), name),
        (Value::from("description"), optional("description")),
        (Value::from("parameters"), optional("parameters")),
    ];
    for key in function.try_iter().map_err(|e| invalid(e.to_string()))? {
        if !matches!(key.as_str(), Some("name" | "description" | "parameters")) {
            let v = function
                .get_item(&key)
                .map_err(|e| invalid(e.to_string()))?;
            fields.push((key, v));
        }
    }
    let kind = tool
        .get_attr("type")
        .ok()
        .filter(|t| !t.is_undefined() && !t.is_none())
        .unwrap_or_else(|| Value::from("function"));
    Ok(Value::from_pairs([
        (Value::from("type"), kind),
        (Value::from("function"), Value::from_pairs(fields)),
    ]))
}

/// `chat_template_kwargs` as template variables. vLLM rejects `chat_template` and `tokenize`.
fn template_kwargs(kwargs: Option<&Value>) -> Result<Vec<(String, Value)>> {
    let Some(kwargs) = kwargs.filter(|k| !k.is_none()) else {
        return Ok(Vec::new());
    };
    if kwargs.kind() != ValueKind::Map {
        return Err(invalid("chat_template_kwargs must be an object"));
    }
    let mut out = Vec::new();
    for key in kwargs.try_iter().map_err(|e| invalid(e.to_string()))? {
        let Some(name) = key.as_str() else {
            continue;
        };
        if matches!(name, "chat_template" | "tokenize") {
            return Err(invalid(format!(
                "unexpected chat template kwarg '{name}' in request"
            )));
        }
        let v = kwargs.get_item(&key).map_err(|e| invalid(e.to_string()))?;
        out.push((name.to_owned(), v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ChatRequest;
    use crate::py_json::{DumpOptions, dumps};

    fn convert(body: &str, format: ContentFormat) -> Result<Conversation> {
        let req = ChatRequest::from_slice(body.as_bytes())?;
        Conversation::from_request(&req, format)
    }

    fn json(v: &Value) -> String {
        dumps(v, &DumpOptions::default()).unwrap()
    }

    #[test]
    fn string_format_joins_parts_and_fills_missing_content() {
        let conv = convert(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b",
                {"type": "text"}, {"type": "refusal", "refusal": "c"}]}, {"role": "assistant"}]}"#,
            ContentFormat::String,
        )
        .unwrap();
        assert_eq!(
            json(&conv.messages),
            r#"[{"role": "user", "content": "a\nb\nc"}, {"role": "assistant", "content": ""}]"#
        );
        assert!(conv.add_generation_prompt);
        assert!(conv.tools.is_none());
    }

    #[test]
    fn openai_format_wraps_text_parts() {
        let conv = convert(
            r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}"#,
            ContentFormat::OpenAi,
        )
        .unwrap();
        assert_eq!(
            json(&conv.messages),
            r#"[{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": []}]"#
        );
    }

    #[test]
    fn assistant_fields_follow_vllm_and_transformers() {
        let conv = convert(
            r#"{"messages": [{"role": "assistant", "content": "x", "name": "bot", "id": "dropped",
                "reasoning_content": "why", "tool_calls": [{"id": "1", "type": "function",
                "function": {"arguments": "{\"b\": 1, \"a\": 2.0}", "name": "f"}},
                {"id": "2", "function": {"name": "g"}}]},
                {"role": "tool", "tool_call_id": "1", "content": "ok", "reasoning": "ignored"}]}"#,
            ContentFormat::String,
        )
        .unwrap();
        assert_eq!(
            json(&conv.messages),
            concat!(
                r#"[{"thinking": "why", "role": "assistant", "content": "x", "tool_calls": ["#,
                r#"{"id": "1", "type": "function", "function": {"arguments": {"b": 1, "a": 2.0}, "name": "f"}}, "#,
                r#"{"id": "2", "function": {"name": "g", "arguments": {}}}], "reasoning": "why", "#,
                r#""reasoning_content": "why", "name": "bot"}, "#,
                r#"{"role": "tool", "content": "ok", "tool_call_id": "1"}]"#
            )
        );
    }

    #[test]
    fn tools_are_dumped_like_pydantic() {
        let conv = convert(
            r#"{"messages": [{"role": "user", "content": "q"}], "tools": [
                {"function": {"strict": true, "name": "f", "parameters": {"z": 1, "a": 2}}, "type": "function"}]}"#,
            ContentFormat::String,
        )
        .unwrap();
        assert_eq!(
            json(&conv.tools),
            r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}, "strict": true}}]"#
        );
    }

    #[test]
    fn kwargs_and_generation_prompt() {
        let conv = convert(
            r#"{"messages": [{"role": "user", "content": "q"}], "add_generation_prompt": false,
                "chat_template_kwargs": {"enable_thinking": false, "x": [1]}}"#,
            ContentFormat::String,
        )
        .unwrap();
        assert!(!conv.add_generation_prompt);
        let names: Vec<_> = conv.kwargs.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["enable_thinking", "x"]);
    }

    #[test]
    fn bad_requests_are_rejected() {
        let cases = [
            (r#"{"messages": []}"#, true),
            (
                r#"{"messages": [{"role": "user", "content": [{"text": "no type"}]}]}"#,
                true,
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "video_clip"}]}]}"#,
                true,
            ),
            (
                r#"{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]}"#,
                true,
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}]}"#,
                true,
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": {"tokenize": true}}"#,
                true,
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}"#,
                false,
            ),
        ];
        for (body, client_error) in cases {
            let err = convert(body, ContentFormat::String).err().expect(body);
            assert_eq!(err.is_client_error(), client_error, "{body}: {err}");
        }
    }
}

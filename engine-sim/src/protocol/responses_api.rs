//! The OpenAI Responses API (`POST /v1/responses`) as vLLM serves it: the request subset the
//! simulator understands, the response object and the streaming events.

use serde::{Deserialize, Serialize};

use super::InvalidRequest;
use super::requests::{ContentPart, MessageContent};
use crate::chat_template::ChatMessage;

/// `POST /v1/responses`.
#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    /// Requested model; must be the served one when given.
    pub model: Option<String>,
    /// A user message as text, or a list of message items.
    pub input: ResponsesInput,
    /// System instructions, rendered as a leading system message.
    pub instructions: Option<String>,
    /// Tokens to generate.
    pub max_output_tokens: Option<i64>,
    /// Stream SSE events.
    pub stream: Option<bool>,
    /// Conversation state is not kept by the simulator; must be absent.
    pub previous_response_id: Option<String>,
}

/// `input`: text or message items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum ResponsesInput {
    /// One user message.
    Text(String),
    /// Message items.
    Items(Vec<InputItem>),
}

/// One input item; only messages (`type` absent or `message`) are supported.
#[derive(Debug, Deserialize)]
pub(crate) struct InputItem {
    /// Item type.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// `user`, `assistant`, `system`, `developer`.
    pub role: Option<String>,
    /// Text or content parts (`input_text`, `output_text`, `text`).
    pub content: Option<MessageContent>,
}

fn part_text(part: &ContentPart) -> Result<&str, InvalidRequest> {
    match (part.kind.as_str(), &part.text) {
        ("input_text" | "output_text" | "text", Some(t)) => Ok(t),
        (kind, _) => Err(InvalidRequest::field(
            "input",
            format!(
                "content part type `{kind}` is not supported by the simulator (input_text only)"
            ),
        )),
    }
}

impl ResponsesRequest {
    /// The conversation to render: the instructions as a system message, then the input.
    pub(crate) fn chat_messages(&self) -> Result<Vec<ChatMessage>, InvalidRequest> {
        if self.previous_response_id.is_some() {
            return Err(InvalidRequest::field(
                "previous_response_id",
                "previous_response_id is not supported by the simulator (it stores no responses)",
            ));
        }
        let mut messages = Vec::new();
        if let Some(instructions) = &self.instructions {
            messages.push(ChatMessage {
                role: "system".to_owned(),
                content: instructions.clone(),
            });
        }
        match &self.input {
            ResponsesInput::Text(text) => messages.push(ChatMessage {
                role: "user".to_owned(),
                content: text.clone(),
            }),
            ResponsesInput::Items(items) if items.is_empty() => {
                return Err(InvalidRequest::field("input", "input must not be empty"));
            }
            ResponsesInput::Items(items) => {
                for item in items {
                    messages.push(item.chat_message()?);
                }
            }
        }
        Ok(messages)
    }
}

impl InputItem {
    fn chat_message(&self) -> Result<ChatMessage, InvalidRequest> {
        if let Some(kind) = self.kind.as_deref().filter(|k| *k != "message") {
            return Err(InvalidRequest::field(
                "input",
                format!(
                    "input item type `{kind}` is not supported by the simulator (messages only)"
                ),
            ));
        }
        let role = self
            .role
            .clone()
            .ok_or_else(|| InvalidRequest::field("input", "every input message needs a role"))?;
        let content = match &self.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => parts
                .iter()
                .map(part_text)
                .collect::<Result<Vec<_>, _>>()?
                .join("\n"),
        };
        Ok(ChatMessage { role, content })
    }
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct ResponseUsage {
    /// Prompt tokens.
    pub input_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub input_tokens_details: InputTokensDetails,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Always zero reasoning tokens.
    pub output_tokens_details: OutputTokensDetails,
    /// Input plus output tokens.
    pub total_tokens: usize,
}

impl ResponseUsage {
    /// Usage of a prompt of `input` tokens (`cached` from the prefix cache) and `output` tokens.
    pub(crate) fn new(input: usize, cached: usize, output: usize) -> Self {
        Self {
            input_tokens: input,
            input_tokens_details: InputTokensDetails {
                cached_tokens: cached,
            },
            output_tokens: output,
            output_tokens_details: OutputTokensDetails::default(),
            total_tokens: input + output,
        }
    }
}

/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct InputTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct OutputTokensDetails {
    /// Always 0.
    pub reasoning_tokens: usize,
}

/// The `response` object.
#[derive(Debug, Serialize)]
pub(crate) struct ResponseObject<'a> {
    /// `resp_...`.
    pub id: &'a str,
    /// Always `response`.
    pub object: &'static str,
    /// Unix seconds.
    pub created_at: u64,
    /// Served model name.
    pub model: &'a str,
    /// `in_progress` or `completed`.
    pub status: &'static str,
    /// Always null.
    pub error: Option<()>,
    /// Always null.
    pub incomplete_details: Option<()>,
    /// The request's instructions.
    pub instructions: Option<&'a str>,
    /// The request's `max_output_tokens`.
    pub max_output_tokens: Option<usize>,
    /// The assistant message (empty while in progress).
    pub output: Vec<OutputMessage<'a>>,
    /// Token counts; null while in progress.
    pub usage: Option<ResponseUsage>,
}

/// An output item of type `message`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct OutputMessage<'a> {
    /// Always `message`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `msg_...`.
    pub id: &'a str,
    /// `in_progress` or `completed`.
    pub status: &'static str,
    /// Always `assistant`.
    pub role: &'static str,
    /// The text part (none while in progress).
    pub content: Vec<OutputText<'a>>,
}

/// A content part of type `output_text`.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct OutputText<'a> {
    /// Always `output_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The generated text (so far).
    pub text: &'a str,
    /// Always empty.
    pub annotations: [(); 0],
}

impl<'a> OutputText<'a> {
    /// An `output_text` part holding `text`.
    pub(crate) fn new(text: &'a str) -> Self {
        Self {
            kind: "output_text",
            text,
            annotations: [],
        }
    }
}

impl<'a> OutputMessage<'a> {
    /// The assistant message `id`; `text` is `None` while in progress (no content yet).
    pub(crate) fn assistant(id: &'a str, text: Option<&'a str>) -> Self {
        Self {
            kind: "message",
            id,
            status: if text.is_some() {
                "completed"
            } else {
                "in_progress"
            },
            role: "assistant",
            content: text.map(OutputText::new).into_iter().collect(),
        }
    }
}

/// Where a text event points: always the first content part of the first output item.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct TextLocation<'a> {
    /// The message's id.
    pub item_id: &'a str,
    /// Always 0.
    pub output_index: u32,
    /// Always 0.
    pub content_index: u32,
}

/// One streaming event; serialized with `"type": <name>` and its `sequence_number`.
#[derive(Debug, Serialize)]
#[serde(tag = "type")]
pub(crate) enum StreamEvent<'a> {
    /// The response exists (status `in_progress`).
    #[serde(rename = "response.created")]
    Created {
        /// The response so far.
        response: ResponseObject<'a>,
    },
    /// Generation is under way.
    #[serde(rename = "response.in_progress")]
    InProgress {
        /// The response so far.
        response: ResponseObject<'a>,
    },
    /// The assistant message starts.
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        /// Always 0.
        output_index: u32,
        /// The message, without content.
        item: OutputMessage<'a>,
    },
    /// Its text part starts.
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        /// The part's place.
        #[serde(flatten)]
        at: TextLocation<'a>,
        /// The empty part.
        part: OutputText<'a>,
    },
    /// One generated token's text.
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        /// The part's place.
        #[serde(flatten)]
        at: TextLocation<'a>,
        /// New text.
        delta: &'a str,
        /// Always empty.
        logprobs: [(); 0],
    },
    /// The text is complete.
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        /// The part's place.
        #[serde(flatten)]
        at: TextLocation<'a>,
        /// The whole text.
        text: &'a str,
        /// Always empty.
        logprobs: [(); 0],
    },
    /// The text part is complete.
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        /// The part's place.
        #[serde(flatten)]
        at: TextLocation<'a>,
        /// The whole part.
        part: OutputText<'a>,
    },
    /// The assistant message is complete.
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        /// Always 0.
        output_index: u32,
        /// The whole message.
        item: OutputMessage<'a>,
    },
    /// The response is complete, with usage.
    #[serde(rename = "response.completed")]
    Completed {
        /// The whole response.
        response: ResponseObject<'a>,
    },
    /// Generation failed.
    #[serde(rename = "error")]
    Error {
        /// Always null.
        code: Option<()>,
        /// Why.
        message: &'a str,
        /// Always null.
        param: Option<()>,
    },
}

impl StreamEvent<'_> {
    /// The SSE event name (equal to the serialized `type`).
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Created { .. } => "response.created",
            Self::InProgress { .. } => "response.in_progress",
            Self::OutputItemAdded { .. } => "response.output_item.added",
            Self::ContentPartAdded { .. } => "response.content_part.added",
            Self::OutputTextDelta { .. } => "response.output_text.delta",
            Self::OutputTextDone { .. } => "response.output_text.done",
            Self::ContentPartDone { .. } => "response.content_part.done",
            Self::OutputItemDone { .. } => "response.output_item.done",
            Self::Completed { .. } => "response.completed",
            Self::Error { .. } => "error",
        }
    }
}

/// A stream event with its position in the stream.
#[derive(Debug, Serialize)]
pub(crate) struct Sequenced<'a> {
    /// The event.
    #[serde(flatten)]
    pub event: StreamEvent<'a>,
    /// 0, 1, 2, ... within the stream.
    pub sequence_number: u64,
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn messages(body: Value) -> Result<Vec<(String, String)>, InvalidRequest> {
        let req: ResponsesRequest = serde_json::from_value(body).expect("parses");
        req.chat_messages()
            .map(|m| m.into_iter().map(|m| (m.role, m.content)).collect())
    }

    #[test]
    fn text_and_items_become_chat_messages() {
        let got = messages(json!({"input": "hi", "instructions": "be brief"})).ok();
        assert_eq!(
            got,
            Some(vec![
                ("system".into(), "be brief".into()),
                ("user".into(), "hi".into())
            ])
        );
        let got = messages(json!({"input": [
            {"role": "user", "content": "a"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "c"}, {"type": "input_text", "text": "d"}]}
        ]}))
        .ok();
        assert_eq!(
            got,
            Some(vec![
                ("user".into(), "a".into()),
                ("assistant".into(), "b".into()),
                ("user".into(), "c\nd".into())
            ])
        );
    }

    #[test]
    fn unsupported_input_is_rejected() {
        for body in [
            json!({"input": []}),
            json!({"input": [{"type": "function_call", "name": "f"}]}),
            json!({"input": [{"content": "no role"}]}),
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            json!({"input": "x", "previous_response_id": "resp_1"}),
        ] {
            assert!(messages(body.clone()).is_err(), "{body}");
        }
        assert!(serde_json::from_value::<ResponsesRequest>(json!({"input": 3})).is_err());
    }

    #[test]
    fn event_names_match_their_type() {
        let at = TextLocation {
            item_id: "msg_1",
            output_index: 0,
            content_index: 0,
        };
        let events = [
            StreamEvent::OutputTextDelta {
                at,
                delta: "x",
                logprobs: [],
            },
            StreamEvent::OutputItemAdded {
                output_index: 0,
                item: OutputMessage::assistant("msg_1", None),
            },
            StreamEvent::Error {
                code: None,
                message: "m",
                param: None,
            },
        ];
        for event in events {
            let name = event.name();
            let v = serde_json::to_value(Sequenced {
                event,
                sequence_number: 7,
            })
            .expect("serializes");
            assert_eq!(v["type"], name);
            assert_eq!(v["sequence_number"], 7);
        }
    }
}

//! Request bodies of the generation endpoints and their normalisation into [`GenParams`].

use std::sync::Arc;

use serde::Deserialize;

use super::InvalidRequest;
use super::prompt::PromptInput;
use crate::chat_template::ChatMessage;
use crate::kv_transfer::params::KvTransferParams;

/// Default `max_tokens` of the OpenAI endpoints.
pub(crate) const DEFAULT_MAX_TOKENS: usize = 16;
/// Default `max_new_tokens` of SGLang's `/generate`.
pub(crate) const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum StopInput {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct StreamOptions {
    /// Send a final chunk with `usage` and no choices.
    pub include_usage: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    /// Requested model; must be the served one when given.
    pub model: Option<String>,
    /// The prompt(s).
    pub prompt: PromptInput,
    /// Tokens to generate.
    pub max_tokens: Option<i64>,
    /// Stream SSE chunks.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Stop strings.
    pub stop: Option<StopInput>,
    /// Choices per prompt (default 1).
    pub n: Option<i64>,
    /// Answer with the prompt before the generated text (a text prompt only here).
    pub echo: Option<bool>,
    /// Prefix-cache namespace (see [`GenParams::with_cache_salt`]).
    pub cache_salt: Option<String>,
    /// Disaggregated serving (vLLM's NixlConnector protocol).
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    /// Requested model; must be the served one when given.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<WireMessage>,
    /// Tokens to generate (deprecated name).
    pub max_tokens: Option<i64>,
    /// Tokens to generate (takes precedence over `max_tokens`).
    pub max_completion_tokens: Option<i64>,
    /// Stream SSE chunks.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Stop strings.
    pub stop: Option<StopInput>,
    /// Choices (default 1).
    pub n: Option<i64>,
    /// End the rendered prompt with the assistant turn's opening (vLLM's default: true).
    pub add_generation_prompt: Option<bool>,
    /// Leave the final (assistant) message open so generation continues it (vLLM's
    /// `continue_final_message`; needs `add_generation_prompt: false`).
    pub continue_final_message: Option<bool>,
    /// Prefix-cache namespace (see [`GenParams::with_cache_salt`]).
    pub cache_salt: Option<String>,
    /// Disaggregated serving (vLLM's NixlConnector protocol).
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// One chat message as sent.
#[derive(Debug, Deserialize)]
pub(crate) struct WireMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// Text, content parts, or null.
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// Message content: a string or a list of parts.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts (only `text` parts are supported).
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Deserialize)]
pub(crate) struct ContentPart {
    /// Part type; must be `text`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// `POST /v1/embeddings`.
#[derive(Debug, Deserialize)]
pub(crate) struct EmbeddingRequest {
    /// Requested model; must be the served one when given.
    pub model: Option<String>,
    /// The input(s), in any prompt shape.
    pub input: PromptInput,
    /// `float` (default) or `base64`.
    pub encoding_format: Option<String>,
}

/// SGLang `POST /generate`.
#[derive(Debug, Deserialize)]
pub(crate) struct GenerateRequest {
    /// Text prompt(s).
    pub text: Option<PromptInput>,
    /// Token-id prompt(s).
    pub input_ids: Option<PromptInput>,
    /// Sampling parameters.
    pub sampling_params: Option<SglSamplingParams>,
    /// Stream SSE chunks with cumulative text.
    pub stream: Option<bool>,
}

/// SGLang `sampling_params` (the supported subset).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct SglSamplingParams {
    /// Tokens to generate.
    pub max_new_tokens: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopInput>,
}

/// The most choices (`n`) one request may ask for.
const MAX_CHOICES: i64 = 16;

/// The longest `cache_salt` vLLM accepts, in characters.
const MAX_CACHE_SALT_CHARS: usize = 128;

/// Generation parameters common to every endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GenParams {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Non-empty stop strings.
    pub stops: Arc<[String]>,
    /// Stream the response.
    pub stream: bool,
    /// Streaming: end with a usage-only chunk.
    pub include_usage: bool,
    /// Choices per prompt (`n`), each its own sequence.
    pub n: usize,
    /// The request's `cache_salt`: its prompt's first block (and so every block) is cached
    /// apart from the same prompt's under another salt or none.
    pub cache_salt: Option<Arc<str>>,
}

impl GenParams {
    /// Validates the OpenAI fields shared by completions and chat.
    pub(crate) fn openai(
        max_tokens: Option<i64>,
        stream: Option<bool>,
        stream_options: Option<&StreamOptions>,
        stop: Option<StopInput>,
        n: Option<i64>,
    ) -> Result<Self, InvalidRequest> {
        let n = match n {
            None => 1,
            Some(n @ 1..=MAX_CHOICES) => n as usize,
            Some(n) => {
                return Err(InvalidRequest::field(
                    "n",
                    format!("n must be between 1 and {MAX_CHOICES}, got {n}"),
                ));
            }
        };
        let stream = stream.unwrap_or(false);
        if stream_options.is_some() && !stream {
            return Err(InvalidRequest::field(
                "stream_options",
                "Stream options can only be defined when `stream=True`.",
            ));
        }
        Ok(Self {
            max_tokens: positive("max_tokens", max_tokens, DEFAULT_MAX_TOKENS)?,
            stops: stop_list(stop),
            stream,
            include_usage: stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            n,
            cache_salt: None,
        })
    }

    /// Adds vLLM's `cache_salt` (chat and completions), validated as vLLM 0.33 does
    /// (`validate_cache_salt`): a non-empty string of at most 128 characters without `@`,
    /// `/`, `\` or NUL. vLLM adds it to the extra keys of the prompt's block at token 0, so
    /// the prefix cache shares no block across salts.
    pub(crate) fn with_cache_salt(mut self, salt: Option<String>) -> Result<Self, InvalidRequest> {
        let Some(salt) = salt else {
            return Ok(self);
        };
        if salt.is_empty() {
            return Err(InvalidRequest::field(
                "cache_salt",
                "Parameter 'cache_salt' must be a non-empty string if provided.",
            ));
        }
        if salt.chars().count() > MAX_CACHE_SALT_CHARS || salt.contains(['@', '/', '\\', '\0']) {
            return Err(InvalidRequest::field(
                "cache_salt",
                "Parameter 'cache_salt' must be at most 128 characters and must not contain \
                 '@', '/', '\\', or NUL.",
            ));
        }
        self.cache_salt = Some(Arc::from(salt));
        Ok(self)
    }

    /// Validates the Responses API fields (`max_output_tokens`, `stream`).
    pub(crate) fn responses(
        max_output_tokens: Option<i64>,
        stream: Option<bool>,
    ) -> Result<Self, InvalidRequest> {
        Ok(Self {
            max_tokens: positive("max_output_tokens", max_output_tokens, DEFAULT_MAX_TOKENS)?,
            stops: Arc::from([]),
            stream: stream.unwrap_or(false),
            include_usage: false,
            n: 1,
            cache_salt: None,
        })
    }

    /// Validates SGLang's sampling parameters.
    pub(crate) fn sglang(
        params: SglSamplingParams,
        stream: Option<bool>,
    ) -> Result<Self, InvalidRequest> {
        Ok(Self {
            max_tokens: positive(
                "max_new_tokens",
                params.max_new_tokens,
                DEFAULT_MAX_NEW_TOKENS,
            )?,
            stops: stop_list(params.stop),
            stream: stream.unwrap_or(false),
            include_usage: false,
            n: 1,
            cache_salt: None,
        })
    }
}

fn positive(
    param: &'static str,
    value: Option<i64>,
    default: usize,
) -> Result<usize, InvalidRequest> {
    match value {
        None => Ok(default),
        Some(v) if v >= 1 => {
            usize::try_from(v).map_err(|_| InvalidRequest::field(param, "value too large"))
        }
        Some(v) => Err(InvalidRequest::field(
            param,
            format!("{param} must be at least 1, got {v}."),
        )),
    }
}

fn stop_list(stop: Option<StopInput>) -> Arc<[String]> {
    let list = match stop {
        None => Vec::new(),
        Some(StopInput::One(s)) => vec![s],
        Some(StopInput::Many(v)) => v,
    };
    list.into_iter().filter(|s| !s.is_empty()).collect()
}

/// vLLM 0.32's 400 for a chat request without messages (its `param` is null).
pub(crate) fn non_empty_conversation(messages: &[ChatMessage]) -> Result<(), InvalidRequest> {
    if messages.is_empty() {
        return Err(InvalidRequest {
            message: "Cannot apply chat template to an empty conversation. Provide at least \
                      one message."
                .to_owned(),
            param: None,
        });
    }
    Ok(())
}

impl ChatRequest {
    /// The messages with their content parts joined by newlines.
    pub(crate) fn chat_messages(&self) -> Result<Vec<ChatMessage>, InvalidRequest> {
        self.messages
            .iter()
            .map(|m| {
                let content = match &m.content {
                    None => String::new(),
                    Some(MessageContent::Text(t)) => t.clone(),
                    Some(MessageContent::Parts(parts)) => {
                        let mut texts = Vec::with_capacity(parts.len());
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => texts.push(t.as_str()),
                                (kind, _) => {
                                    return Err(InvalidRequest::field(
                                        "messages",
                                        format!("content part type `{kind}` is not supported by the simulator (text only)"),
                                    ));
                                }
                            }
                        }
                        texts.join("\n")
                    }
                };
                Ok(ChatMessage { role: m.role.clone(), content })
            })
            .collect()
    }

    /// `max_completion_tokens`, else `max_tokens`.
    pub(crate) fn max_tokens(&self) -> Option<i64> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_defaults_and_validation() {
        let p = GenParams::openai(None, None, None, None, None).ok();
        assert_eq!(
            p.map(|p| (p.max_tokens, p.stream, p.include_usage)),
            Some((16, false, false))
        );
        assert!(GenParams::openai(Some(0), None, None, None, None).is_err());
        assert!(GenParams::openai(Some(-3), None, None, None, None).is_err());
        assert!(GenParams::openai(None, None, None, None, Some(0)).is_err());
        assert!(GenParams::openai(None, None, None, None, Some(MAX_CHOICES + 1)).is_err());
        let p = GenParams::openai(None, None, None, None, Some(3)).ok();
        assert_eq!(p.map(|p| p.n), Some(3));
        let opts = StreamOptions {
            include_usage: Some(true),
        };
        assert!(GenParams::openai(None, Some(false), Some(&opts), None, None).is_err());
        let p = GenParams::openai(
            Some(5),
            Some(true),
            Some(&opts),
            Some(StopInput::Many(vec!["".into(), "x".into()])),
            Some(1),
        );
        let p = p.ok();
        assert_eq!(p.as_ref().map(|p| p.include_usage), Some(true));
        assert_eq!(p.map(|p| p.stops.to_vec()), Some(vec!["x".to_owned()]));
    }

    #[test]
    fn cache_salt_is_validated_as_vllm_does() {
        let salt = |s: &str| {
            GenParams::openai(None, None, None, None, None)
                .and_then(|p| p.with_cache_salt(Some(s.to_owned())))
                .map(|p| p.cache_salt.map(|s| s.to_string()))
        };
        assert_eq!(salt("tenant-a").ok(), Some(Some("tenant-a".to_owned())));
        assert_eq!(salt(&"é".repeat(128)).map(|s| s.is_some()).ok(), Some(true));
        for bad in ["", "a@b", "a/b", "a\\b", "a\0b", &"x".repeat(129)] {
            let error = salt(bad).expect_err(bad);
            assert_eq!(error.param, Some("cache_salt"), "{bad}");
        }
        let none =
            GenParams::openai(None, None, None, None, None).and_then(|p| p.with_cache_salt(None));
        assert_eq!(none.map(|p| p.cache_salt).ok(), Some(None));
        let req: CompletionRequest =
            serde_json::from_str(r#"{"prompt":"x","cache_salt":"s"}"#).expect("valid");
        assert_eq!(req.cache_salt.as_deref(), Some("s"));
        let req: ChatRequest =
            serde_json::from_str(r#"{"messages":[],"cache_salt":"s"}"#).expect("valid");
        assert_eq!(req.cache_salt.as_deref(), Some("s"));
        assert!(serde_json::from_str::<ChatRequest>(r#"{"messages":[],"cache_salt":5}"#).is_err());
    }

    #[test]
    fn chat_request_parses_parts_and_nulls() {
        let body = r#"{"model":"m","messages":[{"role":"system","content":null},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
            "max_tokens":3,"max_completion_tokens":7}"#;
        let req: ChatRequest = serde_json::from_str(body).expect("valid");
        let msgs = req.chat_messages().expect("text parts");
        assert_eq!(msgs[0].content, "");
        assert_eq!(msgs[1].content, "a\nb");
        assert_eq!(req.max_tokens(), Some(7));
    }

    #[test]
    fn chat_rejects_non_text_parts_and_missing_messages() {
        let body = r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
        let req: ChatRequest = serde_json::from_str(body).expect("parses");
        assert!(req.chat_messages().is_err());
        assert!(serde_json::from_str::<ChatRequest>(r#"{"model":"m"}"#).is_err());
        assert!(serde_json::from_str::<ChatRequest>(r#"{"messages":"hi"}"#).is_err());
    }

    #[test]
    fn completion_request_requires_prompt() {
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"model":"m"}"#).is_err());
        assert!(
            serde_json::from_str::<CompletionRequest>(r#"{"prompt":"x","max_tokens":"7"}"#)
                .is_err()
        );
        let ok: CompletionRequest =
            serde_json::from_str(r#"{"prompt":[1,2],"stop":"x","stream":null}"#).expect("valid");
        assert_eq!(ok.prompt, PromptInput::Tokens(vec![1, 2]));
    }

    #[test]
    fn an_empty_conversation_is_refused_as_vllm_does() {
        let error = non_empty_conversation(&[]).expect_err("no messages");
        assert_eq!(
            error.message,
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        );
        assert_eq!(error.param, None);
        let one = ChatMessage {
            role: "user".to_owned(),
            content: "hi".to_owned(),
        };
        assert!(non_empty_conversation(&[one]).is_ok());
    }

    #[test]
    fn sglang_defaults() {
        let p = GenParams::sglang(SglSamplingParams::default(), None).ok();
        assert_eq!(p.map(|p| p.max_tokens), Some(DEFAULT_MAX_NEW_TOKENS));
    }
}

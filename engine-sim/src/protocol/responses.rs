//! Response bodies in vLLM's OpenAI shapes (and SGLang's for `/generate`).

use std::borrow::Cow;

use serde::Serialize;

use crate::kv_transfer::params::KvTransferParams;

/// `usage` of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt plus completion tokens.
    pub total_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache, as vLLM reports them with
    /// `--enable-prompt-tokens-details` (absent without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct PromptTokensDetails {
    /// Prompt tokens whose KV blocks were already cached.
    pub cached_tokens: usize,
}

impl Usage {
    /// Empty counts; `details`: report `prompt_tokens_details`.
    pub(crate) fn new(details: bool) -> Self {
        Self {
            prompt_tokens_details: details.then(PromptTokensDetails::default),
            ..Self::default()
        }
    }

    /// Adds one sequence's counts (`cached`: its prompt tokens served from the cache).
    pub(crate) fn add(&mut self, prompt: usize, cached: usize, completion: usize) {
        self.prompt_tokens += prompt;
        self.completion_tokens += completion;
        self.total_tokens = self.prompt_tokens + self.completion_tokens;
        if let Some(details) = self.prompt_tokens_details.as_mut() {
            details.cached_tokens += cached;
        }
    }
}

/// Non-streaming `text_completion`.
#[derive(Debug, Serialize)]
pub(crate) struct Completion<'a> {
    /// `cmpl-...`.
    pub id: &'a str,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: &'a str,
    /// One choice per prompt.
    pub choices: Vec<CompletionChoice<'a>>,
    /// Token counts; omitted on streaming chunks other than the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// A prefill leg's handle on its held KV, for the decode leg. vLLM puts the key on every
    /// whole answer (`null` but on a prefill leg) and on no stream chunk: `Some(None)` is the
    /// `null`, `None` leaves the key out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<Option<KvTransferParams>>,
}

/// A completion choice (also the streaming chunk choice).
#[derive(Debug, Serialize)]
pub(crate) struct CompletionChoice<'a> {
    /// Prompt index.
    pub index: u32,
    /// Generated text (a delta when streaming), after the prompt with `echo`.
    pub text: Cow<'a, str>,
    /// Always null.
    pub logprobs: Option<()>,
    /// `stop`, `length`, or null before the end.
    pub finish_reason: Option<&'static str>,
    /// The matched stop string, if any.
    pub stop_reason: Option<&'a str>,
}

/// Non-streaming `chat.completion`, or a `chat.completion.chunk`.
#[derive(Debug, Serialize)]
pub(crate) struct ChatCompletion<'a, C> {
    /// `chatcmpl-...`.
    pub id: &'a str,
    /// `chat.completion` or `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: &'a str,
    /// Choices.
    pub choices: Vec<C>,
    /// Token counts; omitted on streaming chunks other than the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// A prefill leg's handle on its held KV, for the decode leg. vLLM puts the key on every
    /// whole answer (`null` but on a prefill leg) and on no stream chunk: `Some(None)` is the
    /// `null`, `None` leaves the key out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<Option<KvTransferParams>>,
}

/// A non-streaming chat choice.
#[derive(Debug, Serialize)]
pub(crate) struct ChatChoice<'a> {
    /// Choice index.
    pub index: u32,
    /// The assistant message.
    pub message: ChatMessageOut<'a>,
    /// Always null.
    pub logprobs: Option<()>,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
    /// The matched stop string, if any.
    pub stop_reason: Option<&'a str>,
}

/// The assistant message of a chat choice.
#[derive(Debug, Serialize)]
pub(crate) struct ChatMessageOut<'a> {
    /// Always `assistant`.
    pub role: &'static str,
    /// Generated text.
    pub content: &'a str,
}

/// A streaming chat choice.
#[derive(Debug, Serialize)]
pub(crate) struct ChatChunkChoice<'a> {
    /// Choice index.
    pub index: u32,
    /// The delta.
    pub delta: ChatDelta<'a>,
    /// Always null.
    pub logprobs: Option<()>,
    /// Set on the last content chunk.
    pub finish_reason: Option<&'static str>,
    /// The matched stop string: vLLM sends the key (often `null`) on the chunk that carries
    /// `finish_reason` only; `None` leaves it out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Option<&'a str>>,
}

/// A streaming chat delta; the first carries the role.
#[derive(Debug, Serialize)]
pub(crate) struct ChatDelta<'a> {
    /// `assistant` on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<&'a str>,
}

/// `/v1/embeddings` response.
#[derive(Debug, Serialize)]
pub(crate) struct EmbeddingList<'a> {
    /// `embd-...`.
    pub id: &'a str,
    /// Always `list`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: &'a str,
    /// One entry per input.
    pub data: Vec<EmbeddingData>,
    /// Token counts (completion is 0).
    pub usage: Usage,
}

/// One embedding.
#[derive(Debug, Serialize)]
pub(crate) struct EmbeddingData {
    /// Always `embedding`.
    pub object: &'static str,
    /// Input index.
    pub index: usize,
    /// The vector: a float list, or a base64 string of little-endian f32s.
    pub embedding: EmbeddingValue,
}

/// An embedding in the requested encoding.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum EmbeddingValue {
    /// `encoding_format: float`.
    Floats(Vec<f32>),
    /// `encoding_format: base64`.
    Base64(String),
}

/// SGLang `/generate` result for one prompt.
#[derive(Debug, Serialize)]
pub(crate) struct GenerateOut<'a> {
    /// Generated text (cumulative when streaming).
    pub text: &'a str,
    /// Request metadata.
    pub meta_info: GenerateMeta<'a>,
}

/// SGLang `meta_info`.
#[derive(Debug, Serialize)]
pub(crate) struct GenerateMeta<'a> {
    /// Request id.
    pub id: &'a str,
    /// Null until the end.
    pub finish_reason: Option<SglFinish<'a>>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens so far.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// SGLang finish reason object.
#[derive(Debug, Serialize)]
pub(crate) struct SglFinish<'a> {
    /// `length` or `stop`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// For `length`: the limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub length: Option<usize>,
    /// For `stop`: the matched string.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matched: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(kv: Option<Option<KvTransferParams>>) -> serde_json::Value {
        let body = Completion {
            id: "cmpl-1",
            object: "text_completion",
            created: 0,
            model: "m",
            choices: Vec::new(),
            usage: None,
            kv_transfer_params: kv,
        };
        serde_json::to_value(&body).unwrap()
    }

    #[test]
    fn kv_transfer_params_is_null_on_a_whole_answer_and_absent_from_chunks() {
        // vLLM 0.32: `"kv_transfer_params": null` on every non-streamed answer.
        assert_eq!(
            chunk(Some(None))["kv_transfer_params"],
            serde_json::Value::Null
        );
        assert!(
            chunk(Some(None))
                .as_object()
                .unwrap()
                .contains_key("kv_transfer_params")
        );
        assert!(
            !chunk(None)
                .as_object()
                .unwrap()
                .contains_key("kv_transfer_params")
        );
    }

    #[test]
    fn a_chat_chunk_carries_stop_reason_only_with_its_finish_reason() {
        let choice = |finish: Option<&'static str>, stop: Option<Option<&'static str>>| {
            serde_json::to_value(ChatChunkChoice {
                index: 0,
                delta: ChatDelta {
                    role: None,
                    content: Some("x"),
                },
                logprobs: None,
                finish_reason: finish,
                stop_reason: stop,
            })
            .unwrap()
        };
        let last = choice(Some("length"), Some(None));
        assert_eq!(last["stop_reason"], serde_json::Value::Null);
        assert!(last.as_object().unwrap().contains_key("stop_reason"));
        assert!(
            !choice(None, None)
                .as_object()
                .unwrap()
                .contains_key("stop_reason")
        );
    }
}

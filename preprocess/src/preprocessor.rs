//! [`ModelPreprocessor`]: one model's chat template and tokenizer.

use std::fs;
use std::path::Path;

use minijinja::Value;

use crate::chat_template::ChatTemplate;
use crate::content_format::ContentFormat;
use crate::conversation::Conversation;
use crate::encoder_kind::{EncoderKind, EncoderPreference};
use crate::error::{PreprocessError, Result};
use crate::qwen3_template;
use crate::request::ChatRequest;
use crate::text_encoder::TextEncoder;
use crate::tokenizer_config::TokenizerConfig;

/// The file names read from a model's tokenizer directory.
const TOKENIZER_FILE: &str = "tokenizer.json";
const CONFIG_FILE: &str = "tokenizer_config.json";
const TEMPLATE_FILE: &str = "chat_template.jinja";

/// Template variables a request's `chat_template_kwargs` cannot replace.
const RESERVED_VARS: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Renders chat requests and tokenizes prompts exactly as vLLM does for one model.
///
/// Built once per model from its tokenizer directory and shared (it is `Send + Sync`); every
/// method takes `&self` and does no I/O.
#[derive(Debug)]
pub struct ModelPreprocessor {
    encoder: TextEncoder,
    template: Option<ChatTemplate>,
    content_format: ContentFormat,
    /// The chat template is Qwen3's: plain conversations render natively
    /// ([`crate::qwen3_template`]).
    pub(crate) qwen3_template: bool,
    /// `(name, content)` of the named special tokens, passed to every template render.
    special_tokens: Vec<(&'static str, String)>,
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).map_err(|source| PreprocessError::Io {
        path: path.to_owned(),
        source,
    })
}

impl ModelPreprocessor {
    /// Loads `tokenizer.json` and `tokenizer_config.json` from `dir` and compiles the chat template.
    ///
    /// The template comes from `chat_template.jinja` when the directory has one (newer
    /// Hugging Face checkpoints), otherwise from `chat_template` in the config (a string, or the
    /// `default` / `tool_use` entries of a list). A model without a template loads fine; only
    /// [`render_chat`](Self::render_chat) then fails. The content format is detected from the
    /// template as vLLM's `auto` mode does.
    ///
    /// Text is encoded by the native encoder when it supports the tokenizer exactly (byte-level
    /// BPE shaped like Qwen2 / Qwen3 / Llama-3), else by Hugging Face `tokenizers`; see
    /// [`from_dir_with_encoder`](Self::from_dir_with_encoder) and [`encoder`](Self::encoder).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Self::from_dir_with_encoder(dir, EncoderPreference::Auto)
    }

    /// [`from_dir`](Self::from_dir), choosing the encoder: `Auto` as there, or always Hugging
    /// Face `tokenizers`. Which one a model uses is logged (`info`) when it loads.
    pub fn from_dir_with_encoder(
        dir: impl AsRef<Path>,
        encoder: EncoderPreference,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join(CONFIG_FILE);
        let mut config = TokenizerConfig::parse(&read(&config_path)?, &config_path)?;
        let template_path = dir.join(TEMPLATE_FILE);
        if template_path.is_file() {
            config.chat_template = Some(read(&template_path)?);
        }
        let encoder = TextEncoder::load(&dir.join(TOKENIZER_FILE), &config, encoder)?;

        let main = config
            .chat_template
            .as_deref()
            .or(config.tool_use_template.as_deref());
        let template = main
            .map(|main| ChatTemplate::compile(main, config.tool_use_template.as_deref()))
            .transpose()?;
        let content_format = main.map_or(ContentFormat::String, ContentFormat::detect);
        Ok(Self {
            encoder,
            template,
            content_format,
            qwen3_template: main.is_some_and(qwen3_template::is_qwen3),
            special_tokens: config.special_tokens,
        })
    }

    /// Overrides the detected content format (vLLM's `--chat-template-content-format`).
    pub fn with_content_format(mut self, format: ContentFormat) -> Self {
        self.content_format = format;
        self
    }

    /// Turns on a cache of the token ids of long message texts (pieces of at least 256 bytes
    /// between special tokens), holding up to about `max_tokens` ids (4 bytes each plus the
    /// text); `0` turns it off. It speeds up [`encode_chat`](Self::encode_chat) for
    /// conversations whose earlier turns were seen before and never changes the ids. Tokenizers
    /// for which pieces cannot be encoded separately (added tokens that strip whitespace,
    /// Metaspace pre-tokenizers) keep it off: see [`segment_cache_enabled`](Self::segment_cache_enabled).
    pub fn with_segment_cache(mut self, max_tokens: usize) -> Self {
        self.encoder.set_segment_cache(max_tokens);
        self
    }

    /// Whether the segment cache is on.
    pub fn segment_cache_enabled(&self) -> bool {
        self.encoder.has_segment_cache()
    }

    /// The encoder the model's text goes through.
    pub fn encoder(&self) -> EncoderKind {
        self.encoder.kind()
    }

    /// The content format messages are rendered with.
    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// True when the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Renders the chat template for `request`, as vLLM's `apply_chat_template(...,
    /// tokenize=False)` does: variables `messages`, `tools`, `documents` (none),
    /// `add_generation_prompt` (default true), the model's named special tokens (`bos_token`,
    /// `eos_token`, ...) and the request's `chat_template_kwargs` (e.g. `enable_thinking`).
    ///
    /// A template that calls `raise_exception` gives [`PreprocessError::Template`] with the
    /// template's message.
    pub fn render_chat(&self, request: &ChatRequest<'_>) -> Result<String> {
        if self.qwen3_template
            && self.content_format == ContentFormat::String
            && let Some(rendered) = qwen3_template::render(request)
        {
            return Ok(rendered);
        }
        self.render_chat_with_template_engine(request)
    }

    /// [`render_chat`](Self::render_chat) through minijinja, whatever the template.
    pub(crate) fn render_chat_with_template_engine(
        &self,
        request: &ChatRequest<'_>,
    ) -> Result<String> {
        let template = self
            .template
            .as_ref()
            .ok_or(PreprocessError::NoChatTemplate)?;
        let conversation = Conversation::from_request(request, self.content_format)?;
        let mut vars: Vec<(&str, Value)> =
            Vec::with_capacity(4 + self.special_tokens.len() + conversation.kwargs.len());
        for (name, content) in &self.special_tokens {
            vars.push((name, Value::from(content.as_str())));
        }
        for (name, value) in &conversation.kwargs {
            if RESERVED_VARS.contains(&name.as_str()) {
                continue;
            }
            match vars.iter_mut().find(|(n, _)| *n == name) {
                Some(slot) => slot.1 = value.clone(),
                None => vars.push((name, value.clone())),
            }
        }
        let with_tools = !conversation.tools.is_none();
        vars.push(("messages", conversation.messages));
        vars.push(("tools", conversation.tools));
        vars.push(("documents", Value::from(())));
        vars.push((
            "add_generation_prompt",
            Value::from(conversation.add_generation_prompt),
        ));
        template.render(&Value::from_pairs(vars), with_tools)
    }

    /// Token ids of a rendered chat prompt: `add_special_tokens=False`, as vLLM encodes chats
    /// (the template already wrote every special token).
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>> {
        self.encoder.encode(rendered, false)
    }

    /// Token ids of a completions prompt: `add_special_tokens=True` (BOS/EOS as the model adds them).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.encoder.encode(text, true)
    }

    /// Token ids of text that continues other tokens (`add_special_tokens=False`): what a
    /// stream generated, appended to its token-id prompt when the stream moves elsewhere.
    pub fn encode_continuation(&self, text: &str) -> Result<Vec<u32>> {
        self.encoder.encode(text, false)
    }

    /// [`render_chat`](Self::render_chat) then [`encode_chat`](Self::encode_chat).
    pub fn chat_token_ids(&self, request: &ChatRequest<'_>) -> Result<Vec<u32>> {
        self.encode_chat(&self.render_chat(request)?)
    }
}

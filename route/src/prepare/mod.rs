//! From a request body to the prompt's block hashes: template, tokenizer, hasher.
//!
//! - Chat: [`ChatRequest::from_slice`], the model's chat template, the tokenizer
//!   (`add_special_tokens = false`, as vLLM). A template error (`raise_exception`) or an
//!   invalid chat body is the client's fault: 400 with its message. Content the preprocessor
//!   cannot turn into the engine's exact tokens (images, audio) routes without tokens.
//! - Completions: a string prompt is tokenized (`add_special_tokens = true`); token ids are
//!   used as given; a list routes by its first element ([`prompt`]). With
//!   `forward_token_ids`, a single string prompt is replaced by its ids in the forwarded body.
//! - Embeddings and responses route without tokens: embeddings leave no KV cache behind, and
//!   the responses API's input is not rendered by the preprocessor yet.
//! - Chat and completions bodies may carry `cache_salt` (vLLM's per-request prefix-cache
//!   namespace): it salts the first block's hash, so the prompt matches only blocks cached
//!   under the same salt, as vLLM only reuses those ([`kvmesh_kv::salted_local_hash`]; the
//!   worker-agent salts the engine's blocks alike).
//!
//! Everything here is synchronous; [`offload`] decides where it runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvmesh_kv::{BlockHasher, BlockHashes};
use kvmesh_preprocess::{ChatRequest, ModelPreprocessor, PreprocessError};

pub mod offload;
mod prompt;
mod responses;

use prompt::{Prompt, completion_fields, generate_fields, has_messages, with_token_prompt};

/// What kind of prompt a request body carries, by the endpoint it was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    /// A chat-completions body: `messages`, rendered with the chat template.
    Chat,
    /// A completions body: `prompt`, a string or token ids.
    Completion,
    /// vLLM's `/tokenize`: `messages` (rendered like chat) or `prompt` (like completions,
    /// never rewritten).
    Tokenize,
    /// vLLM's `/inference/v1/generate`: `token_ids`, used as given.
    TokenIds,
    /// A responses body: `instructions` and `input`, rendered as vLLM renders them with
    /// the chat template ([`responses::responses_as_chat`]).
    Responses,
    /// No prompt to route by (embeddings, responses, anything else): routed by load alone.
    Other,
}

/// A prompt's size and block hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptBlocks {
    /// Prompt tokens.
    pub tokens: usize,
    /// Hashes of the full blocks.
    pub hashes: BlockHashes,
    /// Tokens per block.
    pub block_size: usize,
}

impl PromptBlocks {
    /// Hashes `ids` with `hasher`.
    pub fn hash(ids: &[u32], hasher: &mut BlockHasher) -> Self {
        Self::hash_salted(ids, None, hasher)
    }

    /// Hashes `ids` with `hasher`, the first block salted with `cache_salt`
    /// ([`BlockHasher::hash_salted`]; `None` hashes as [`PromptBlocks::hash`]).
    pub fn hash_salted(ids: &[u32], cache_salt: Option<&str>, hasher: &mut BlockHasher) -> Self {
        Self {
            tokens: ids.len(),
            hashes: hasher.hash_salted(ids, cache_salt),
            block_size: hasher.block_size(),
        }
    }

    /// Whether the prompt ends in a partial block.
    pub fn has_tail(&self) -> bool {
        self.tokens > self.hashes.len() * self.block_size
    }
}

/// Why a request is routed by load alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// The model has no `tokenizer` configured.
    NoTokenizer,
    /// The route has no prompt to route by (embeddings, responses).
    Route,
    /// The prompt holds content the preprocessor cannot tokenize exactly (images, audio).
    UnsupportedContent,
    /// The tokenizer directory has no chat template.
    NoChatTemplate,
    /// The body has no prompt, or one of an unknown shape (the engine will judge it).
    NoPrompt,
    /// The tokenizer failed.
    TokenizeFailed,
}

/// Number of [`FallbackReason`]s.
pub const FALLBACK_REASONS: usize = 6;

impl FallbackReason {
    /// Every reason, in [`FallbackReason::index`] order.
    pub const ALL: [FallbackReason; FALLBACK_REASONS] = [
        Self::NoTokenizer,
        Self::Route,
        Self::UnsupportedContent,
        Self::NoChatTemplate,
        Self::NoPrompt,
        Self::TokenizeFailed,
    ];

    /// Position in [`FallbackReason::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Label in metrics, logs and `x-kvmesh-route`.
    pub fn label(self) -> &'static str {
        match self {
            Self::NoTokenizer => "no_tokenizer",
            Self::Route => "route",
            Self::UnsupportedContent => "unsupported_content",
            Self::NoChatTemplate => "no_chat_template",
            Self::NoPrompt => "no_prompt",
            Self::TokenizeFailed => "tokenize_failed",
        }
    }
}

/// What routing knows about a request's prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteInput {
    /// Its blocks.
    Tokens(Arc<PromptBlocks>),
    /// No tokens: routed by load alone.
    Fallback(FallbackReason),
}

/// Time spent per stage (`None`: the stage did not run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StageTimes {
    /// Parsing the body: for chat, rendering its template too; for completions, reading
    /// the prompt.
    pub template: Option<Duration>,
    /// Tokenizing.
    pub tokenize: Option<Duration>,
    /// Hashing the blocks.
    pub hash: Option<Duration>,
}

/// A prepared request.
#[derive(Debug)]
pub struct Prepared {
    /// Routing input.
    pub input: RouteInput,
    /// Stage timings.
    pub times: StageTimes,
    /// The body to forward when it was rewritten (`forward_token_ids`).
    pub rewritten: Option<Bytes>,
}

impl Prepared {
    /// A request routed without tokens.
    pub fn fallback(reason: FallbackReason, times: StageTimes) -> Self {
        Self {
            input: RouteInput::Fallback(reason),
            times,
            rewritten: None,
        }
    }
}

/// The request is invalid; answered with 400 and this message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPrompt(pub String);

/// A model's preprocessing settings (cheap to clone: the tokenizer is shared).
#[derive(Debug, Clone)]
pub struct Preparer {
    tokenizer: Option<Arc<ModelPreprocessor>>,
    /// Tokens per block, shared with the model's router (an instance record may set it).
    block_size: Arc<AtomicU64>,
    forward_token_ids: bool,
    /// The LoRA adapter whose seed the block hashes use (`None`: the base model).
    adapter: Option<Arc<str>>,
}

impl Preparer {
    /// Preprocessing with `tokenizer` (if any) into blocks of `block_size` tokens.
    pub fn new(
        tokenizer: Option<Arc<ModelPreprocessor>>,
        block_size: usize,
        forward_token_ids: bool,
    ) -> Self {
        let block_size = Arc::new(AtomicU64::new(block_size.max(1) as u64));
        Self::with_shared_block_size(tokenizer, block_size, forward_token_ids)
    }

    /// [`Preparer::new`] hashing by whatever `block_size` holds when a request comes (the
    /// model's router sets it from the first instance record).
    pub(crate) fn with_shared_block_size(
        tokenizer: Option<Arc<ModelPreprocessor>>,
        block_size: Arc<AtomicU64>,
        forward_token_ids: bool,
    ) -> Self {
        Self {
            tokenizer,
            block_size,
            forward_token_ids,
            adapter: None,
        }
    }

    /// The model's tokenizer, when it has one.
    pub fn tokenizer(&self) -> Option<&Arc<ModelPreprocessor>> {
        self.tokenizer.as_ref()
    }

    /// The same settings for requests to the LoRA adapter `adapter`: the same template and
    /// tokenizer, block hashes seeded with the adapter's name (as the agent hashes the
    /// adapter's cached blocks), so its prompts match only the adapter's blocks.
    pub fn for_adapter(&self, adapter: Arc<str>) -> Self {
        Self {
            adapter: Some(adapter),
            ..self.clone()
        }
    }

    /// Prepares a request carrying a `kind` prompt in `body`; `forward` allows the
    /// `forward_token_ids` rewrite (the admin explain endpoint forwards nothing).
    pub fn prepare(
        &self,
        kind: PromptKind,
        body: &Bytes,
        forward: bool,
    ) -> Result<Prepared, InvalidPrompt> {
        match kind {
            PromptKind::Chat => self.chat(body),
            PromptKind::Completion => Ok(self.completion(body, forward)),
            PromptKind::Tokenize if has_messages(body) => self.chat(body),
            PromptKind::Tokenize => Ok(self.completion(body, false)),
            PromptKind::TokenIds => Ok(self.token_ids(body)),
            PromptKind::Responses => Ok(self.responses(body)),
            PromptKind::Other => Ok(Prepared::fallback(
                FallbackReason::Route,
                StageTimes::default(),
            )),
        }
    }

    /// Hashes `ids` into blocks, the first salted with the request's `cache_salt` (as vLLM
    /// salts the prompt's first block, and the agent the engine's first block of it).
    fn hash(
        &self,
        ids: &[u32],
        cache_salt: Option<&str>,
        mut times: StageTimes,
    ) -> (RouteInput, StageTimes) {
        let start = Instant::now();
        let block_size = self.block_size.load(Ordering::Relaxed).max(1) as usize;
        let hasher = BlockHasher::new(block_size, self.adapter.as_deref());
        let input = match hasher {
            Ok(mut hasher) => RouteInput::Tokens(Arc::new(PromptBlocks::hash_salted(
                ids,
                cache_salt,
                &mut hasher,
            ))),
            Err(_) => RouteInput::Fallback(FallbackReason::TokenizeFailed),
        };
        times.hash = Some(start.elapsed());
        (input, times)
    }

    fn chat(&self, body: &Bytes) -> Result<Prepared, InvalidPrompt> {
        let mut times = StageTimes::default();
        let Some(model) = self.tokenizer.as_deref() else {
            return Ok(Prepared::fallback(FallbackReason::NoTokenizer, times));
        };
        let start = Instant::now();
        let rendered = ChatRequest::from_slice(body)
            .and_then(|request| model.render_chat(&request).map(|text| (request, text)));
        times.template = Some(start.elapsed());
        let (request, rendered) = match rendered {
            Ok(rendered) => rendered,
            Err(error) => return fallback_or_invalid(error, times),
        };
        let start = Instant::now();
        let ids = model.encode_chat(&rendered);
        times.tokenize = Some(start.elapsed());
        let ids = match ids {
            Ok(ids) => ids,
            Err(error) => return fallback_or_invalid(error, times),
        };
        let (input, times) = self.hash(&ids, request.cache_salt(), times);
        Ok(Prepared {
            input,
            times,
            rewritten: None,
        })
    }

    /// A responses body rendered as chat; one that cannot be (history, tool calls, other
    /// content) or that the template refuses is routed without tokens: the engine judges it.
    fn responses(&self, body: &Bytes) -> Prepared {
        let start = Instant::now();
        let Some(chat) = responses::responses_as_chat(body) else {
            let times = StageTimes {
                template: Some(start.elapsed()),
                ..StageTimes::default()
            };
            return Prepared::fallback(FallbackReason::NoPrompt, times);
        };
        self.chat(&Bytes::from(chat))
            .unwrap_or_else(|InvalidPrompt(message)| {
                tracing::debug!(%message, "routing a responses body without tokens");
                Prepared::fallback(FallbackReason::UnsupportedContent, StageTimes::default())
            })
    }

    fn token_ids(&self, body: &Bytes) -> Prepared {
        let mut times = StageTimes::default();
        let start = Instant::now();
        let fields = generate_fields(body);
        times.template = Some(start.elapsed());
        let Ok((Some(Prompt::Tokens(ids)), cache_salt)) = fields else {
            return Prepared::fallback(FallbackReason::NoPrompt, times);
        };
        let (input, times) = self.hash(&ids, cache_salt.as_deref(), times);
        Prepared {
            input,
            times,
            rewritten: None,
        }
    }

    fn completion(&self, body: &Bytes, forward: bool) -> Prepared {
        let mut times = StageTimes::default();
        let start = Instant::now();
        let fields = completion_fields(body);
        times.template = Some(start.elapsed());
        let (prompt, cache_salt) = match fields {
            Ok((Some(prompt), cache_salt)) => (prompt, cache_salt),
            Ok((None, _)) | Err(_) => return Prepared::fallback(FallbackReason::NoPrompt, times),
        };
        let cache_salt = cache_salt.as_deref();
        let (text, single) = match prompt {
            Prompt::Tokens(ids) => {
                let (input, times) = self.hash(&ids, cache_salt, times);
                return Prepared {
                    input,
                    times,
                    rewritten: None,
                };
            }
            Prompt::Text(text) => (text, true),
            Prompt::FirstText(text) => (text, false),
        };
        let Some(model) = self.tokenizer.as_deref() else {
            return Prepared::fallback(FallbackReason::NoTokenizer, times);
        };
        let start = Instant::now();
        let ids = model.encode_prompt(&text);
        times.tokenize = Some(start.elapsed());
        let Ok(ids) = ids else {
            return Prepared::fallback(FallbackReason::TokenizeFailed, times);
        };
        let rewrite = single && forward && self.forward_token_ids && !ids.is_empty();
        let rewritten = rewrite
            .then(|| with_token_prompt(body, &text, &ids))
            .flatten();
        let (input, times) = self.hash(&ids, cache_salt, times);
        Prepared {
            input,
            times,
            rewritten,
        }
    }
}

/// Client errors become 400s; anything else routes without tokens.
fn fallback_or_invalid(
    error: PreprocessError,
    times: StageTimes,
) -> Result<Prepared, InvalidPrompt> {
    if error.is_client_error() {
        return Err(InvalidPrompt(error.to_string()));
    }
    let reason = match error {
        PreprocessError::UnsupportedContent(_) => FallbackReason::UnsupportedContent,
        PreprocessError::NoChatTemplate => FallbackReason::NoChatTemplate,
        _ => FallbackReason::TokenizeFailed,
    };
    tracing::debug!(%error, reason = reason.label(), "routing without tokens");
    Ok(Prepared::fallback(reason, times))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preparer(forward_token_ids: bool) -> Preparer {
        Preparer::new(None, 4, forward_token_ids)
    }

    fn tokens(prepared: &Prepared) -> &PromptBlocks {
        match &prepared.input {
            RouteInput::Tokens(blocks) => blocks,
            RouteInput::Fallback(reason) => panic!("fell back: {reason:?}"),
        }
    }

    #[test]
    fn token_id_prompts_need_no_tokenizer() {
        let body = Bytes::from_static(br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9]}"#);
        let prepared = preparer(false)
            .prepare(PromptKind::Completion, &body, true)
            .unwrap();
        let blocks = tokens(&prepared);
        assert_eq!(blocks.tokens, 9);
        assert_eq!(blocks.hashes.len(), 2);
        assert!(blocks.has_tail());
        let mut hasher = BlockHasher::new(4, None).unwrap();
        assert_eq!(blocks.hashes, hasher.hash(&[1, 2, 3, 4, 5, 6, 7, 8, 9]));
        assert!(prepared.times.hash.is_some());
        assert!(prepared.times.template.is_some(), "parsing the prompt");
        assert_eq!(prepared.times.tokenize, None);
        assert!(prepared.rewritten.is_none());
    }

    #[test]
    fn generate_and_tokenize_bodies_are_routed_by_their_tokens() {
        let p = preparer(true);
        let ids = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let generate = Bytes::from_static(
            br#"{"token_ids":[1,2,3,4,5,6,7,8,9],"sampling_params":{"max_tokens":4},"cache_salt":"t"}"#,
        );
        let prepared = p.prepare(PromptKind::TokenIds, &generate, true).unwrap();
        assert_eq!(
            tokens(&prepared).hashes,
            hasher.hash_salted(&ids, Some("t"))
        );
        // A /tokenize body of the completions shape: its ids, never rewritten.
        let tokenize = Bytes::from_static(br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9]}"#);
        let prepared = p.prepare(PromptKind::Tokenize, &tokenize, true).unwrap();
        assert_eq!(tokens(&prepared).hashes, hasher.hash(&ids));
        assert!(prepared.rewritten.is_none());
        // Of the chat shape: rendered like chat (no tokenizer here: routed without tokens).
        let chat = Bytes::from_static(br#"{"messages":[{"role":"user","content":"hi"}]}"#);
        let prepared = p.prepare(PromptKind::Tokenize, &chat, true).unwrap();
        assert!(matches!(
            prepared.input,
            RouteInput::Fallback(FallbackReason::NoTokenizer)
        ));
        let no_ids = Bytes::from_static(br#"{"prompt":[1,2,3]}"#);
        let prepared = p.prepare(PromptKind::TokenIds, &no_ids, true).unwrap();
        assert!(matches!(
            prepared.input,
            RouteInput::Fallback(FallbackReason::NoPrompt)
        ));
    }

    #[test]
    fn adapter_prompts_are_hashed_with_the_adapter_seed() {
        let body = Bytes::from_static(br#"{"model":"sql-lora","prompt":[1,2,3,4,5,6,7,8]}"#);
        let base = preparer(false);
        let adapter = base.for_adapter(Arc::from("sql-lora"));
        let hashes = |p: &Preparer| {
            tokens(&p.prepare(PromptKind::Completion, &body, true).unwrap())
                .hashes
                .clone()
        };
        let mut seeded = BlockHasher::new(4, Some("sql-lora")).unwrap();
        assert_eq!(hashes(&adapter), seeded.hash(&[1, 2, 3, 4, 5, 6, 7, 8]));
        assert_ne!(hashes(&adapter), hashes(&base));
        let other = base.for_adapter(Arc::from("chat-lora"));
        assert_ne!(hashes(&adapter), hashes(&other));
    }

    #[test]
    fn cache_salt_salts_chat_and_completion_prompts() {
        let p = preparer(false);
        let hashes = |body: &'static str| {
            tokens(
                &p.prepare(
                    PromptKind::Completion,
                    &Bytes::from_static(body.as_bytes()),
                    true,
                )
                .unwrap(),
            )
            .hashes
            .clone()
        };
        let ids = [1, 2, 3, 4, 5, 6, 7, 8];
        let mut hasher = BlockHasher::new(4, None).unwrap();
        let plain = hasher.hash(&ids);
        let a = hashes(r#"{"prompt":[1,2,3,4,5,6,7,8],"cache_salt":"tenant-a"}"#);
        assert_eq!(a, hasher.hash_salted(&ids, Some("tenant-a")));
        assert_ne!(a.sequence[0], plain.sequence[0]);
        assert_ne!(a.sequence[1], plain.sequence[1]);
        let b = hashes(r#"{"cache_salt":"tenant-b","prompt":[[1,2,3,4,5,6,7,8]]}"#);
        assert_eq!(b, hasher.hash_salted(&ids, Some("tenant-b")));
        assert_ne!(a, b);
        // No salt, an empty one or one of another type: the plain hashes.
        for body in [
            r#"{"prompt":[1,2,3,4,5,6,7,8]}"#,
            r#"{"prompt":[1,2,3,4,5,6,7,8],"cache_salt":null}"#,
            r#"{"prompt":[1,2,3,4,5,6,7,8],"cache_salt":""}"#,
            r#"{"prompt":[1,2,3,4,5,6,7,8],"cache_salt":7}"#,
        ] {
            assert_eq!(hashes(body), plain, "{body}");
        }
        // The LoRA seed and the salt together, as the agent hashes an adapter's salted blocks.
        let body = Bytes::from_static(br#"{"prompt":[1,2,3,4,5,6,7,8],"cache_salt":"tenant-a"}"#);
        let adapter = p.for_adapter(Arc::from("sql-lora"));
        let prepared = adapter
            .prepare(PromptKind::Completion, &body, true)
            .unwrap();
        let mut seeded = BlockHasher::new(4, Some("sql-lora")).unwrap();
        assert_eq!(
            tokens(&prepared).hashes,
            seeded.hash_salted(&ids, Some("tenant-a"))
        );
    }

    #[test]
    fn requests_without_usable_tokens_fall_back() {
        let p = preparer(false);
        let cases = [
            (
                PromptKind::Chat,
                r#"{"messages":[]}"#,
                FallbackReason::NoTokenizer,
            ),
            (
                PromptKind::Completion,
                r#"{"prompt":"text"}"#,
                FallbackReason::NoTokenizer,
            ),
            (
                PromptKind::Completion,
                r#"{"prompt":[]}"#,
                FallbackReason::NoPrompt,
            ),
            (
                PromptKind::Completion,
                r#"{"prompt":{"x":1}}"#,
                FallbackReason::NoPrompt,
            ),
            (PromptKind::Other, r#"{"input":"x"}"#, FallbackReason::Route),
        ];
        for (kind, body, reason) in cases {
            let prepared = p
                .prepare(kind, &Bytes::from_static(body.as_bytes()), true)
                .unwrap();
            assert_eq!(prepared.input, RouteInput::Fallback(reason), "{body}");
        }
    }

    #[test]
    fn fallback_reasons_have_distinct_labels() {
        let mut labels: Vec<_> = FallbackReason::ALL.iter().map(|r| r.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), FALLBACK_REASONS);
        for (i, reason) in FallbackReason::ALL.iter().enumerate() {
            assert_eq!(reason.index(), i);
        }
    }

    #[test]
    fn only_client_errors_are_rejected() {
        let invalid = fallback_or_invalid(
            PreprocessError::Template("no tools allowed".into()),
            StageTimes::default(),
        );
        assert_eq!(
            invalid.unwrap_err(),
            InvalidPrompt("no tools allowed".into())
        );
        let image = fallback_or_invalid(
            PreprocessError::UnsupportedContent("image_url".into()),
            StageTimes::default(),
        )
        .unwrap();
        assert_eq!(
            image.input,
            RouteInput::Fallback(FallbackReason::UnsupportedContent)
        );
        let missing = fallback_or_invalid(PreprocessError::NoChatTemplate, StageTimes::default());
        assert_eq!(
            missing.unwrap().input,
            RouteInput::Fallback(FallbackReason::NoChatTemplate)
        );
    }
}

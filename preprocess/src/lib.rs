//! kvmesh request preprocessing: chat templates and tokenization for KV-aware routing.
//!
//! KV-aware routing hashes a prompt's token ids block by block, so the ids must equal what the
//! engine computes. For a vLLM engine serving a Hugging Face model that means: vLLM's message
//! normalisation, the model's Jinja chat template rendered like `transformers` renders it, then
//! the model's `tokenizer.json` (`add_special_tokens=False` for chats, `True` for completions).
//!
//! ```no_run
//! use kvmesh_preprocess::{ChatRequest, ModelPreprocessor};
//!
//! # fn main() -> Result<(), kvmesh_preprocess::PreprocessError> {
//! let model = ModelPreprocessor::from_dir("/models/qwen3")?;
//! let body = br#"{"model": "qwen3", "messages": [{"role": "user", "content": "Hi"}]}"#;
//! let request = ChatRequest::from_slice(body)?;
//! let prompt = model.render_chat(&request)?;
//! let ids = model.encode_chat(&prompt)?;
//! # let _ = ids;
//! # Ok(())
//! # }
//! ```
//!
//! Qwen3's own chat template renders plain conversations without the template engine
//! (`qwen3_template`: the same text, held to minijinja by a property test); other templates
//! and other requests render through minijinja.
//!
//! Long multi-turn prompts repeat their history on every request; an optional segment cache
//! ([`ModelPreprocessor::with_segment_cache`]) reuses the ids of long messages seen before.
//!
//! Tokenization runs on the calling thread. Tokenizers shaped like Qwen2 / Qwen3 / Llama-3 ones
//! (byte-level BPE with their split regex) go through a native encoder that gives the same ids
//! as Hugging Face `tokenizers` many times faster; other tokenizers use `tokenizers` itself
//! (whose thread pool only serves batch encoding, which this crate never does).

mod added_token_split;
mod chat_template;
mod content_format;
mod conversation;
mod encode_plan;
mod encoder_kind;
mod error;
mod native;
mod preprocessor;
mod py_json;
mod qwen3_template;
mod request;
mod segment_cache;
mod strftime;
mod template_scan;
mod text_encoder;
mod tokenizer_config;

pub use content_format::ContentFormat;
pub use encoder_kind::{EncoderKind, EncoderPreference};
pub use error::{PreprocessError, Result};
pub use preprocessor::ModelPreprocessor;
pub use request::{CacheSalt, ChatRequest};

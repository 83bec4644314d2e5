//! Which implementation turns a model's text into token ids.

/// The encoder a model's text goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderKind {
    /// kvmesh's byte-level BPE encoder, for tokenizers shaped like Qwen2 / Qwen3 / Llama-3
    /// ones (same ids as Hugging Face `tokenizers`, many times faster).
    Native,
    /// Hugging Face `tokenizers`.
    HuggingFace,
}

/// Which encoder a model is loaded with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncoderPreference {
    /// The native encoder when it supports the model's `tokenizer.json` exactly, otherwise
    /// Hugging Face `tokenizers`.
    #[default]
    Auto,
    /// Always Hugging Face `tokenizers` (to compare, or to rule the native encoder out).
    HuggingFace,
}

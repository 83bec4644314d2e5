//! Prompt tokenization: a Hugging Face `tokenizer.json`, or a cheap deterministic fallback.

use std::path::Path;
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

use crate::error::SimError;

/// Ids produced by the fallback tokenizer are below this bound (Qwen's base vocabulary size).
pub const FALLBACK_VOCAB: u64 = 151_643;

/// Turns text into token ids.
#[derive(Clone)]
pub(crate) enum Tokenizer {
    /// Splits on whitespace and punctuation and hashes each piece to an id.
    Fallback,
    /// A real tokenizer loaded from `tokenizer.json`.
    HuggingFace(Arc<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fallback => f.write_str("Tokenizer::Fallback"),
            Self::HuggingFace(_) => f.write_str("Tokenizer::HuggingFace"),
        }
    }
}

impl Tokenizer {
    /// Loads `path` as a Hugging Face tokenizer, or the fallback when `None`.
    pub(crate) fn load(path: Option<&Path>) -> Result<Self, SimError> {
        let Some(path) = path else {
            return Ok(Self::Fallback);
        };
        tokenizers::Tokenizer::from_file(path)
            .map(|t| Self::HuggingFace(Arc::new(t)))
            .map_err(|e| SimError::Tokenizer {
                path: path.display().to_string(),
                message: e.to_string(),
            })
    }

    /// Token ids of `text`; `add_special_tokens` adds e.g. a BOS token where the tokenizer has one.
    pub(crate) fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        match self {
            Self::Fallback => Ok(fallback_encode(text)),
            Self::HuggingFace(t) => t
                .encode(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| format!("tokenization failed: {e}")),
        }
    }
}

/// Fallback rule: runs of alphanumeric characters are one piece, every other non-space
/// character is a piece of its own, whitespace separates; each piece maps to
/// `XXH3_64(piece) mod 151,643`.
pub(crate) fn fallback_encode(text: &str) -> Vec<u32> {
    let mut ids = Vec::with_capacity(text.len() / 4 + 1);
    let mut start: Option<usize> = None;
    for (i, c) in text.char_indices() {
        if c.is_alphanumeric() {
            start.get_or_insert(i);
            continue;
        }
        if let Some(s) = start.take() {
            ids.push(piece_id(&text[s..i]));
        }
        if !c.is_whitespace() {
            ids.push(piece_id(&text[i..i + c.len_utf8()]));
        }
    }
    if let Some(s) = start {
        ids.push(piece_id(&text[s..]));
    }
    ids
}

/// The fallback tokenizer's id of one piece.
pub(crate) fn piece_id(piece: &str) -> u32 {
    // The modulus keeps the value far below u32::MAX, so the cast is lossless.
    (xxh3_64(piece.as_bytes()) % FALLBACK_VOCAB) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_splits_words_and_punctuation() {
        let ids = fallback_encode("Hello, world!  foo_bar");
        assert_eq!(ids.len(), 7);
        assert_eq!(ids[0], piece_id("Hello"));
        assert_eq!(ids[1], piece_id(","));
        assert_eq!(ids[2], piece_id("world"));
        assert_eq!(ids[4], piece_id("foo"));
        assert!(ids.iter().all(|&id| u64::from(id) < FALLBACK_VOCAB));
    }

    #[test]
    fn fallback_is_deterministic_and_handles_empty_text() {
        assert_eq!(fallback_encode("a b c"), fallback_encode("a  b\nc"));
        assert!(fallback_encode("   ").is_empty());
        assert_eq!(fallback_encode("héllo wörld").len(), 2);
    }

    /// A tiny word-level tokenizer.json with one added special token.
    const TINY_TOKENIZER: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 3, "content": "<|im_start|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "<|im_start|>": 3},
                  "unk_token": "[UNK]"}
    }"#;

    #[test]
    fn loads_a_hugging_face_tokenizer_file() {
        let path =
            std::env::temp_dir().join(format!("kvmesh-sim-tokenizer-{}.json", std::process::id()));
        std::fs::write(&path, TINY_TOKENIZER).expect("write temp file");
        let loaded = Tokenizer::load(Some(&path));
        let _ = std::fs::remove_file(&path);
        let tokenizer = loaded.expect("valid tokenizer.json");
        assert!(matches!(tokenizer, Tokenizer::HuggingFace(_)));
        assert_eq!(tokenizer.encode("hello world", true), Ok(vec![0, 1]));
        assert_eq!(
            tokenizer.encode("<|im_start|>hello nope", false),
            Ok(vec![3, 0, 2])
        );
    }

    #[test]
    fn missing_tokenizer_file_is_an_error() {
        let err = Tokenizer::load(Some(Path::new("/nonexistent/tokenizer.json")));
        assert!(matches!(err, Err(SimError::Tokenizer { .. })));
    }
}

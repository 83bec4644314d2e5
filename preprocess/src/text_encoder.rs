//! Text to token ids with the model's `tokenizer.json`, as Hugging Face's fast tokenizer does.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use tokenizers::Tokenizer;

use crate::added_token_split::AddedTokenSplitter;
use crate::error::{PreprocessError, Result};
use crate::segment_cache::{MIN_CACHED_BYTES, SegmentCache};
use crate::tokenizer_config::TokenizerConfig;

/// How `add_special_tokens=True` adds tokens around a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SpecialTokens {
    /// The post-processor of `tokenizer.json` decides.
    PostProcessor,
    /// `tokenizer_config.json` states `add_bos_token` / `add_eos_token`: transformers replaces the
    /// post-processor with `[BOS] $A [EOS]` per those flags (tokens that do not exist are skipped).
    Explicit { bos: Option<u32>, eos: Option<u32> },
}

/// A loaded tokenizer.
#[derive(Debug)]
pub(crate) struct TextEncoder {
    tokenizer: Tokenizer,
    special: SpecialTokens,
    segment_cache: Option<SegmentCache>,
}

impl TextEncoder {
    /// Loads `tokenizer.json`, applying the BOS/EOS rules of `config`.
    pub(crate) fn load(path: &Path, config: &TokenizerConfig) -> Result<Self> {
        let load_error = |e: tokenizers::Error| PreprocessError::TokenizerLoad {
            path: path.to_owned(),
            message: e.to_string(),
        };
        let mut tokenizer = Tokenizer::from_file(path).map_err(load_error)?;
        // transformers never truncates or pads unless asked to.
        tokenizer.with_truncation(None).map_err(load_error)?;
        tokenizer.with_padding(None);
        Ok(Self::new(tokenizer, config))
    }

    /// Wraps a loaded tokenizer, applying the BOS/EOS rules of `config`.
    fn new(tokenizer: Tokenizer, config: &TokenizerConfig) -> Self {
        let explicit = config.add_bos_token.is_some() || config.add_eos_token.is_some();
        let special = if explicit || tokenizer.get_post_processor().is_none() {
            let id_of = |flag: Option<bool>, name: &str| {
                flag.unwrap_or(false)
                    .then(|| config.special_token(name))
                    .flatten()
                    .and_then(|token| tokenizer.token_to_id(token))
            };
            SpecialTokens::Explicit {
                bos: id_of(config.add_bos_token, "bos_token"),
                eos: id_of(config.add_eos_token, "eos_token"),
            }
        } else {
            SpecialTokens::PostProcessor
        };
        Self {
            tokenizer,
            special,
            segment_cache: None,
        }
    }

    /// Caches the ids of long pieces between added tokens, up to about `max_tokens` ids; `0`
    /// turns the cache off. It stays off for tokenizers where pieces may not be encoded on
    /// their own (see [`AddedTokenSplitter::for_tokenizer`]).
    pub(crate) fn set_segment_cache(&mut self, max_tokens: usize) {
        self.segment_cache = (max_tokens > 0)
            .then(|| AddedTokenSplitter::for_tokenizer(&self.tokenizer))
            .flatten()
            .map(|splitter| SegmentCache::new(splitter, max_tokens));
    }

    /// Whether the segment cache is on.
    pub(crate) fn has_segment_cache(&self) -> bool {
        self.segment_cache.is_some()
    }

    /// Appends the ids of `text` without special-token post-processing.
    fn encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let encoding = self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| PreprocessError::Encode(e.to_string()))?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }

    /// Ids of `text` (no post-processing) through the segment cache: long pieces between added
    /// tokens come from the cache or are encoded and remembered; everything between them
    /// (short pieces and the added tokens) is encoded in one call.
    fn encode_cached(&self, cache: &SegmentCache, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut run_start = 0;
        let mut piece_start = 0;
        let piece =
            |piece: Range<usize>, run_start: &mut usize, out: &mut Vec<u32>| -> Result<()> {
                if piece.len() < MIN_CACHED_BYTES {
                    return Ok(());
                }
                self.encode_into(&text[*run_start..piece.start], out)?;
                let piece_text = &text[piece.clone()];
                match cache.get(piece_text) {
                    Some(ids) => out.extend_from_slice(&ids),
                    None => {
                        let mut ids = Vec::new();
                        self.encode_into(piece_text, &mut ids)?;
                        out.extend_from_slice(&ids);
                        cache.insert(piece_text, Arc::from(ids));
                    }
                }
                *run_start = piece.end;
                Ok(())
            };
        for token in cache.splitter.matches(text) {
            piece(piece_start..token.start, &mut run_start, &mut out)?;
            piece_start = token.end;
        }
        piece(piece_start..text.len(), &mut run_start, &mut out)?;
        self.encode_into(&text[run_start..], &mut out)?;
        Ok(out)
    }

    /// Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model's config says.
    pub(crate) fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        if !add_special_tokens && let Some(cache) = &self.segment_cache {
            return self.encode_cached(cache, text);
        }
        let (post_process, bos, eos) = match (add_special_tokens, self.special) {
            (false, _) => (false, None, None),
            (true, SpecialTokens::PostProcessor) => (true, None, None),
            (true, SpecialTokens::Explicit { bos, eos }) => (false, bos, eos),
        };
        let encoding = self
            .tokenizer
            .encode_fast(text, post_process)
            .map_err(|e| PreprocessError::Encode(e.to_string()))?;
        let ids = encoding.get_ids();
        let mut out = Vec::with_capacity(ids.len() + 2);
        out.extend(bos);
        out.extend_from_slice(ids);
        out.extend(eos);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::str::FromStr;

    use super::*;

    /// A word-level tokenizer whose post-processor wraps a text in `<s> ... </s>`.
    const TOKENIZER: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "</s>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]},
                               "</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "[UNK]": 4},
                  "unk_token": "[UNK]"}
    }"#;

    fn encoder(config: &str) -> TextEncoder {
        let config = TokenizerConfig::parse(config, Path::new("tokenizer_config.json")).unwrap();
        TextEncoder::new(Tokenizer::from_str(TOKENIZER).unwrap(), &config)
    }

    #[test]
    fn post_processor_decides_without_flags() {
        let enc = encoder(r#"{"bos_token": "<s>"}"#);
        assert_eq!(enc.encode("a b", true).unwrap(), [0, 2, 3, 1]);
        assert_eq!(enc.encode("a b", false).unwrap(), [2, 3]);
    }

    #[test]
    fn explicit_flags_replace_the_post_processor() {
        let enc = encoder(r#"{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}"#);
        assert_eq!(enc.encode("a b", true).unwrap(), [0, 2, 3]);
        let enc = encoder(
            r#"{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": false, "add_eos_token": true}"#,
        );
        assert_eq!(enc.encode("b", true).unwrap(), [3, 1]);
        assert_eq!(enc.encode("b", false).unwrap(), [3]);
    }

    #[test]
    fn flags_without_a_token_add_nothing() {
        let enc = encoder(r#"{"add_bos_token": true}"#);
        assert_eq!(enc.encode("a", true).unwrap(), [2]);
    }
}

//! Text to token ids with the model's `tokenizer.json`, as Hugging Face's fast tokenizer does:
//! with the native encoder when it supports the tokenizer, else with `tokenizers` itself.

use std::path::Path;
use std::str::FromStr;

use tokenizers::{Encoding, Token, Tokenizer};

use crate::added_token_split::AddedTokenSplitter;
use crate::encode_plan;
use crate::encoder_kind::{EncoderKind, EncoderPreference};
use crate::error::{PreprocessError, Result};
use crate::native::NativeEncoder;
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

impl SpecialTokens {
    /// The rule for `tokenizer` with `config`.
    fn of(tokenizer: &Tokenizer, config: &TokenizerConfig) -> Self {
        let explicit = config.add_bos_token.is_some() || config.add_eos_token.is_some();
        if explicit || tokenizer.get_post_processor().is_none() {
            let id_of = |flag: Option<bool>, name: &str| {
                flag.unwrap_or(false)
                    .then(|| config.special_token(name))
                    .flatten()
                    .and_then(|token| tokenizer.token_to_id(token))
            };
            Self::Explicit {
                bos: id_of(config.add_bos_token, "bos_token"),
                eos: id_of(config.add_eos_token, "eos_token"),
            }
        } else {
            Self::PostProcessor
        }
    }
}

/// The ids `tokenizer`'s post-processor puts before and after a single sequence: found by
/// post-processing a one-token sequence with a sentinel id. `Err` when the post-processor does
/// more than wrap the sequence.
fn post_processor_affixes(tokenizer: &Tokenizer) -> Result<(Vec<u32>, Vec<u32>), String> {
    const SENTINEL: u32 = u32::MAX;
    let sequence = Encoding::from_tokens(vec![Token::new(SENTINEL, String::new(), (0, 0))], 0);
    let processed = tokenizer
        .post_process(sequence, None, true)
        .map_err(|e| e.to_string())?;
    let ids = processed.get_ids();
    match ids.iter().position(|&id| id == SENTINEL) {
        Some(at) if !ids[at + 1..].contains(&SENTINEL) => {
            Ok((ids[..at].to_vec(), ids[at + 1..].to_vec()))
        }
        _ => Err("the post-processor does more than add tokens around a text".to_owned()),
    }
}

/// What turns text into ids.
#[derive(Debug)]
enum Backend {
    /// The native encoder, and the ids `add_special_tokens=True` puts around a text.
    Native {
        encoder: NativeEncoder,
        prefix: Vec<u32>,
        suffix: Vec<u32>,
    },
    /// Hugging Face `tokenizers`.
    HuggingFace {
        tokenizer: Tokenizer,
        special: SpecialTokens,
    },
}

impl Backend {
    /// The native backend for `tokenizer` (loaded from `json`), or why it cannot be used.
    fn native(json: &str, tokenizer: &Tokenizer, special: SpecialTokens) -> Result<Self, String> {
        let encoder = NativeEncoder::new(json, tokenizer)?;
        let (prefix, suffix) = match special {
            SpecialTokens::PostProcessor => post_processor_affixes(tokenizer)?,
            SpecialTokens::Explicit { bos, eos } => {
                (bos.into_iter().collect(), eos.into_iter().collect())
            }
        };
        Ok(Self::Native {
            encoder,
            prefix,
            suffix,
        })
    }
}

/// A loaded tokenizer.
#[derive(Debug)]
pub(crate) struct TextEncoder {
    backend: Backend,
    /// Cuts texts at added tokens for the segment cache; `None` when pieces between added
    /// tokens may not be encoded on their own (see [`AddedTokenSplitter::for_tokenizer`]).
    splitter: Option<AddedTokenSplitter>,
    segment_cache: Option<SegmentCache>,
    /// Threads one long text may be encoded on: the cores available, at most
    /// [`encode_plan::MAX_PARTS`].
    parts: usize,
}

impl TextEncoder {
    /// Loads `tokenizer.json`, applying the BOS/EOS rules of `config`, with the native encoder
    /// when `preference` allows and it supports the tokenizer. Logs which encoder it uses.
    pub(crate) fn load(
        path: &Path,
        config: &TokenizerConfig,
        preference: EncoderPreference,
    ) -> Result<Self> {
        let json = std::fs::read_to_string(path).map_err(|source| PreprocessError::Io {
            path: path.to_owned(),
            source,
        })?;
        let load_error = |e: tokenizers::Error| PreprocessError::TokenizerLoad {
            path: path.to_owned(),
            message: e.to_string(),
        };
        let mut tokenizer = Tokenizer::from_str(&json).map_err(load_error)?;
        // transformers never truncates or pads unless asked to.
        tokenizer.with_truncation(None).map_err(load_error)?;
        tokenizer.with_padding(None);
        let native_json = (preference == EncoderPreference::Auto).then_some(json.as_str());
        let (encoder, fallback_reason) = Self::new(tokenizer, config, native_json);
        match fallback_reason {
            None => {
                tracing::info!(tokenizer = %path.display(), encoder = "native", "tokenizer loaded")
            }
            Some(reason) => tracing::info!(
                tokenizer = %path.display(),
                encoder = "huggingface",
                %reason,
                "tokenizer loaded"
            ),
        }
        Ok(encoder)
    }

    /// Wraps a loaded tokenizer, applying the BOS/EOS rules of `config`; with the native
    /// encoder when `native_json` (the text `tokenizer` was loaded from) is given and supported,
    /// else with the reason it is not used.
    fn new(
        tokenizer: Tokenizer,
        config: &TokenizerConfig,
        native_json: Option<&str>,
    ) -> (Self, Option<String>) {
        let special = SpecialTokens::of(&tokenizer, config);
        let splitter = AddedTokenSplitter::for_tokenizer(&tokenizer);
        let native = match native_json {
            Some(json) => Backend::native(json, &tokenizer, special),
            None => Err("Hugging Face tokenizers was asked for".to_owned()),
        };
        let (backend, fallback_reason) = match native {
            Ok(backend) => (backend, None),
            Err(reason) => (Backend::HuggingFace { tokenizer, special }, Some(reason)),
        };
        let encoder = Self {
            backend,
            splitter,
            segment_cache: None,
            parts: std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(encode_plan::MAX_PARTS),
        };
        (encoder, fallback_reason)
    }

    /// Which encoder this is.
    pub(crate) fn kind(&self) -> EncoderKind {
        match self.backend {
            Backend::Native { .. } => EncoderKind::Native,
            Backend::HuggingFace { .. } => EncoderKind::HuggingFace,
        }
    }

    /// Caches the ids of long pieces between added tokens, up to about `max_tokens` ids; `0`
    /// turns the cache off. It stays off for tokenizers where pieces may not be encoded on
    /// their own (see [`AddedTokenSplitter::for_tokenizer`]).
    pub(crate) fn set_segment_cache(&mut self, max_tokens: usize) {
        self.segment_cache = (max_tokens > 0)
            .then(|| self.splitter.clone())
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
        match &self.backend {
            Backend::Native { encoder, .. } => encoder.encode_into(text, out),
            Backend::HuggingFace { tokenizer, .. } => {
                let encoding = tokenizer
                    .encode_fast(text, false)
                    .map_err(|e| PreprocessError::Encode(e.to_string()))?;
                out.extend_from_slice(encoding.get_ids());
            }
        }
        Ok(())
    }

    /// Ids of `text` (no post-processing) through the segment cache: long pieces between added
    /// tokens come from the cache or are encoded and remembered, everything between them (short
    /// pieces and the added tokens) is encoded in runs; a long text's runs and pieces are shared
    /// between threads ([`encode_plan`]).
    fn encode_cached(&self, cache: &SegmentCache, text: &str) -> Result<Vec<u32>> {
        let cut: Option<encode_plan::Cut> = match self.backend {
            Backend::Native { .. } => Some(NativeEncoder::cut_at_or_after),
            Backend::HuggingFace { .. } => None,
        };
        let encode = |text: &str, out: &mut Vec<u32>| self.encode_into(text, out);
        encode_plan::encode_cached(cache, text, self.parts, &encode, cut)
    }

    /// Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model's config says.
    pub(crate) fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        // A text shorter than the shortest cached piece has nothing to look up.
        if !add_special_tokens
            && text.len() >= MIN_CACHED_BYTES
            && let Some(cache) = &self.segment_cache
        {
            return self.encode_cached(cache, text);
        }
        let (tokenizer, special) = match &self.backend {
            Backend::Native {
                encoder,
                prefix,
                suffix,
            } => {
                let mut out = Vec::with_capacity(text.len() / 3 + prefix.len() + suffix.len());
                if add_special_tokens {
                    out.extend_from_slice(prefix);
                }
                encoder.encode_into(text, &mut out);
                if add_special_tokens {
                    out.extend_from_slice(suffix);
                }
                return Ok(out);
            }
            Backend::HuggingFace { tokenizer, special } => (tokenizer, *special),
        };
        let (post_process, bos, eos) = match (add_special_tokens, special) {
            (false, _) => (false, None, None),
            (true, SpecialTokens::PostProcessor) => (true, None, None),
            (true, SpecialTokens::Explicit { bos, eos }) => (false, bos, eos),
        };
        let encoding = tokenizer
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
        let (encoder, fallback_reason) = TextEncoder::new(
            Tokenizer::from_str(TOKENIZER).unwrap(),
            &config,
            Some(TOKENIZER),
        );
        assert!(
            fallback_reason.is_some(),
            "a word-level tokenizer is not native"
        );
        assert_eq!(encoder.kind(), EncoderKind::HuggingFace);
        encoder
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

    /// The Qwen3 tokenizer fetched by `scripts/fetch-tokenizer.sh`, with `preference`.
    fn qwen3(preference: EncoderPreference) -> TextEncoder {
        let dir = match std::env::var_os("KVMESH_QWEN3_TOKENIZER") {
            Some(dir) => std::path::PathBuf::from(dir),
            None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3"),
        };
        let config_path = dir.join("tokenizer_config.json");
        let config_text = std::fs::read_to_string(&config_path)
            .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-tokenizer.sh)", dir.display()));
        let config = TokenizerConfig::parse(&config_text, &config_path).unwrap();
        TextEncoder::load(&dir.join("tokenizer.json"), &config, preference).unwrap()
    }

    /// Long texts, of over twice [`encode_plan::PARALLEL_MIN_BYTES`]: a chat of several long
    /// turns, one long piece with no added token, and mixed text with long words and numbers.
    fn long_texts() -> Vec<String> {
        let prose = |seed: usize, words: usize| -> String {
            const WORDS: [&str; 8] = [
                "Hello", "world", "naïve", "café", "don't", "12345", "the", "kv-mesh,",
            ];
            (0..words)
                .map(|i| WORDS[(i * 7 + seed) % WORDS.len()])
                .collect::<Vec<_>>()
                .join(if seed.is_multiple_of(2) { " " } else { "  \n" })
        };
        let chat: String = (0..6)
            .map(|turn| format!("<|im_start|>user\n{}<|im_end|>\n", prose(turn, 3_500)))
            .collect();
        let mixed: String = (0..2_500)
            .map(|i| {
                format!(
                    "{} A\u{30a} 😀 x{i} 全角 {}\n",
                    prose(i, 5),
                    "é".repeat(i % 3)
                )
            })
            .collect();
        vec![chat, prose(0, 22_000), mixed]
    }

    #[test]
    fn long_texts_encode_the_same_on_any_number_of_threads() {
        let mut reference = qwen3(EncoderPreference::HuggingFace);
        let mut native = qwen3(EncoderPreference::Auto);
        assert_eq!(native.kind(), EncoderKind::Native);
        for text in long_texts() {
            assert!(text.len() > 2 * encode_plan::PARALLEL_MIN_BYTES);
            let want = reference.encode(&text, false).unwrap();
            for parts in 1..=encode_plan::MAX_PARTS {
                native.parts = parts;
                native.set_segment_cache(1 << 22);
                assert_eq!(
                    native.encode(&text, false).unwrap(),
                    want,
                    "cold, {parts} parts"
                );
                assert_eq!(
                    native.encode(&text, false).unwrap(),
                    want,
                    "warm, {parts} parts"
                );
            }
        }
        // `tokenizers` itself: stretches go to threads whole (no cut inside a piece).
        let chat = &long_texts()[0];
        let want = reference.encode(chat, false).unwrap();
        reference.parts = 2;
        reference.set_segment_cache(1 << 22);
        assert_eq!(reference.encode(chat, false).unwrap(), want);
    }
}

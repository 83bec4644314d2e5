//! A native encoder for byte-level BPE tokenizers of the Qwen2 / Qwen3 / Llama-3 family, giving
//! the same ids as Hugging Face `tokenizers` at a fraction of the cost.
//!
//! The pipeline is `tokenizers`' own, specialised: cut the text at added tokens
//! ([`AddedTokenSplitter`]); NFC-normalize each piece between them when the tokenizer says so
//! ([`nfc`]); split it like the pre-tokenizer regex, by hand ([`pieces`]); and encode every
//! piece with the BPE merges ([`bpe_model`], [`merge`]) — pieces that are a single token,
//! the common case, cost one hash lookup, and other short pieces are cached ([`piece_cache`]). [`spec`] decides which `tokenizer.json` files it
//! supports; the others stay with `tokenizers`.

mod bpe_model;
mod byte_level;
mod char_class;
mod fast_hash;
mod merge;
mod nfc;
mod piece_cache;
mod pieces;
mod spec;
#[cfg(test)]
pub(crate) mod test_text;

use std::borrow::Cow;

use tokenizers::Tokenizer;

use crate::added_token_split::AddedTokenSplitter;
use bpe_model::BpeModel;
use pieces::PieceSplitter;
use spec::NativeSpec;

/// A text exercising the pre-tokenizer's corners, encoded by both encoders when a tokenizer
/// loads: a native encoder that disagrees with `tokenizers` on it is not used.
const PROBE: &str = "Hello, world! It's 2024: naïve café, e\u{301}, A\u{30a}. I'LL say 'S, 'ſ and \
    'Re.\n\n  Indented\tline \r\n\u{a0}nbsp\u{3000}全角 中文字符 😀👍🏽 12345 ½ Ⅻ ...\n```rust\n\
    fn main() { println!(\"hi\"); }\n```\n<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>   \
    trailing \n \n\n ";

/// Encodes text to token ids for one supported tokenizer.
#[derive(Debug)]
pub(crate) struct NativeEncoder {
    added: AddedTokenSplitter,
    nfc: bool,
    splitter: PieceSplitter,
    model: BpeModel,
}

impl NativeEncoder {
    /// The encoder for the `tokenizer.json` text `json`, which `tokenizer` was loaded from.
    /// `Err` gives the reason when the tokenizer has a shape this encoder does not support.
    pub(crate) fn new(json: &str, tokenizer: &Tokenizer) -> Result<Self, String> {
        let spec = NativeSpec::parse(json)?;
        let added = AddedTokenSplitter::for_tokenizer(tokenizer)
            .ok_or("added tokens strip whitespace, match single words or are encoded as text")?;
        if tokenizer
            .get_added_vocabulary()
            .get_added_tokens_decoder()
            .values()
            .any(|token| token.normalized)
        {
            return Err("added tokens matched after normalization are not supported".to_owned());
        }
        let merges = spec
            .merges
            .iter()
            .map(|(left, right)| (left.as_str(), right.as_str()));
        let model = BpeModel::new(&spec.vocab, merges, spec.ignore_merges)?;
        let encoder = Self {
            added,
            nfc: spec.nfc,
            splitter: spec.splitter,
            model,
        };
        encoder.check_against(tokenizer)?;
        Ok(encoder)
    }

    /// Compares this encoder with `tokenizer` on [`PROBE`].
    fn check_against(&self, tokenizer: &Tokenizer) -> Result<(), String> {
        let reference = tokenizer
            .encode_fast(PROBE, false)
            .map_err(|e| e.to_string())?;
        let mut ids = Vec::new();
        self.encode_into(PROBE, &mut ids);
        if ids != reference.get_ids() {
            return Err(
                "the native encoder disagrees with tokenizers on the probe text".to_owned(),
            );
        }
        Ok(())
    }

    /// The first byte at or after `at` (looking `within` bytes on) where a text without added
    /// tokens may be cut and its two sides encoded apart, giving the ids of the whole (see
    /// [`PieceSplitter::cut_at_or_after`]).
    pub(crate) fn cut_at_or_after(text: &str, at: usize, within: usize) -> Option<usize> {
        PieceSplitter::cut_at_or_after(text, at, within)
    }

    /// Appends the ids of `text` (no special tokens added) to `out`.
    pub(crate) fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        let mut start = 0;
        for (token, id) in self.added.matches(text) {
            self.encode_between(&text[start..token.start], out);
            out.push(id);
            start = token.end;
        }
        self.encode_between(&text[start..], out);
    }

    /// Appends the ids of a text without added tokens.
    fn encode_between(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let text = if self.nfc {
            nfc::nfc(text)
        } else {
            Cow::Borrowed(text)
        };
        for piece in self.splitter.pieces(&text) {
            self.model.encode_piece(piece.as_bytes(), out);
        }
    }
}

//! Finding a tokenizer's added tokens (`<|im_start|>`, `<|im_end|>`, ...) in a text.
//!
//! `tokenizers` first cuts the input at its added tokens (leftmost-longest match) and then
//! normalizes, pre-tokenizes and encodes every piece between them on its own. So the ids of a
//! text are the concatenation of the ids of those pieces and tokens, which lets the segment
//! cache reuse the ids of pieces it has seen before.

use std::ops::Range;

use tokenizers::Tokenizer;

/// Finds added-token occurrences exactly where `tokenizers`' first extraction pass does.
#[derive(Debug, Clone)]
pub(crate) struct AddedTokenSplitter {
    /// Token contents and ids by first byte, longest first.
    by_first_byte: Vec<Vec<(Box<str>, u32)>>,
}

impl AddedTokenSplitter {
    /// A splitter for `tokenizer`, or `None` when cutting a text into pieces and encoding them
    /// separately might not give the same ids as encoding the whole text: when an added token
    /// strips whitespace or must be a single word, when special tokens are encoded as text, or
    /// when the pre-tokenizer depends on a piece's position (Metaspace).
    pub(crate) fn for_tokenizer(tokenizer: &Tokenizer) -> Option<Self> {
        if tokenizer.get_encode_special_tokens() {
            return None;
        }
        if let Some(pre) = tokenizer.get_pre_tokenizer() {
            let json = serde_json::to_string(pre).ok()?;
            if json.contains("Metaspace") {
                return None;
            }
        }
        let mut by_first_byte: Vec<Vec<(Box<str>, u32)>> = vec![Vec::new(); 256];
        for (&id, token) in tokenizer.get_added_vocabulary().get_added_tokens_decoder() {
            if token.normalized {
                // Matched inside pieces, after normalization: encoding a piece alone does the same.
                continue;
            }
            if token.lstrip || token.rstrip || token.single_word {
                return None;
            }
            if let Some(&first) = token.content.as_bytes().first() {
                by_first_byte[usize::from(first)].push((token.content.as_str().into(), id));
            }
        }
        for tokens in &mut by_first_byte {
            tokens.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
        }
        Some(Self { by_first_byte })
    }

    /// Byte ranges and ids of the added tokens in `text`, in order, non-overlapping,
    /// leftmost-longest.
    pub(crate) fn matches<'s>(
        &'s self,
        text: &'s str,
    ) -> impl Iterator<Item = (Range<usize>, u32)> + 's {
        let bytes = text.as_bytes();
        let mut pos = 0;
        std::iter::from_fn(move || {
            while pos < bytes.len() {
                let skipped = bytes[pos..]
                    .iter()
                    .position(|&b| !self.by_first_byte[usize::from(b)].is_empty());
                let Some(skipped) = skipped else {
                    pos = bytes.len();
                    break;
                };
                let start = pos + skipped;
                let candidates = &self.by_first_byte[usize::from(bytes[start])];
                if let Some((token, id)) = candidates
                    .iter()
                    .find(|(t, _)| bytes[start..].starts_with(t.as_bytes()))
                {
                    pos = start + token.len();
                    return Some((start..pos, *id));
                }
                pos = start + 1;
            }
            None
        })
    }
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;

    fn tokenizer(added: &str, pre_tokenizer: &str) -> Tokenizer {
        let json = format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{added}],
                "normalizer": null, "pre_tokenizer": {pre_tokenizer}, "post_processor": null, "decoder": null,
                "model": {{"type": "WordLevel", "vocab": {{"a": 0, "<|x|>": 1, "<|xy|>": 2, "<y>": 3, "[UNK]": 4}},
                          "unk_token": "[UNK]"}}}}"#
        );
        Tokenizer::from_str(&json).unwrap()
    }

    fn added(content: &str, id: u32, lstrip: bool, normalized: bool) -> String {
        format!(
            r#"{{"id": {id}, "content": "{content}", "single_word": false, "lstrip": {lstrip},
                "rstrip": false, "normalized": {normalized}, "special": true}}"#
        )
    }

    #[test]
    fn leftmost_longest_matches() {
        let tokens = [
            added("<|x|>", 1, false, false),
            added("<|xy|>", 2, false, false),
            added("<y>", 3, true, true),
        ];
        let t = tokenizer(&tokens.join(","), r#"{"type": "Whitespace"}"#);
        let splitter = AddedTokenSplitter::for_tokenizer(&t).unwrap();
        let text = "a<|xy|>b<|x|><|x|>c<y><|x";
        let found: Vec<_> = splitter
            .matches(text)
            .map(|(r, id)| (&text[r], id))
            .collect();
        // "<y>" is a normalized token: it is matched inside pieces, not by this pass.
        assert_eq!(found, [("<|xy|>", 2), ("<|x|>", 1), ("<|x|>", 1)]);
    }

    #[test]
    fn unsafe_tokenizers_get_no_splitter() {
        let strip = tokenizer(&added("<|x|>", 1, true, false), r#"{"type": "Whitespace"}"#);
        assert!(AddedTokenSplitter::for_tokenizer(&strip).is_none());
        let metaspace = tokenizer(
            &added("<|x|>", 1, false, false),
            r#"{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true}"#,
        );
        assert!(AddedTokenSplitter::for_tokenizer(&metaspace).is_none());
    }
}

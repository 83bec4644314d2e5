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
    /// The distinct first bytes of the tokens, so that a text is searched with `memchr` when
    /// there are at most three (all of Qwen's and Llama's added tokens start with `<`).
    first_bytes: Vec<u8>,
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
        let first_bytes = (0..=u8::MAX)
            .filter(|&b| !by_first_byte[usize::from(b)].is_empty())
            .collect();
        Some(Self {
            by_first_byte,
            first_bytes,
        })
    }

    /// Where the first byte that starts some token is in `bytes`.
    fn next_candidate(&self, bytes: &[u8]) -> Option<usize> {
        match *self.first_bytes.as_slice() {
            [] => None,
            [a] => memchr::memchr(a, bytes),
            [a, b] => memchr::memchr2(a, b, bytes),
            [a, b, c] => memchr::memchr3(a, b, c, bytes),
            _ => bytes
                .iter()
                .position(|&b| !self.by_first_byte[usize::from(b)].is_empty()),
        }
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
                let skipped = self.next_candidate(&bytes[pos..]);
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
    fn tokens_with_any_number_of_first_bytes_are_found() {
        let contents = ["[a]", "{b}", "#c", "<d>", "[aa]"];
        for n in 1..=contents.len() {
            let tokens: Vec<String> = (0u32..)
                .zip(&contents[..n])
                .map(|(id, content)| added(content, id + 5, false, false))
                .collect();
            let t = tokenizer(&tokens.join(","), r#"{"type": "Whitespace"}"#);
            let splitter = AddedTokenSplitter::for_tokenizer(&t).unwrap();
            let text = "x[aa]y{b}#c <d>[a]z[a";
            let found: Vec<_> = splitter
                .matches(text)
                .map(|(r, id)| (&text[r], id))
                .collect();
            let want: Vec<_> = [("[aa]", 9), ("{b}", 6), ("#c", 7), ("<d>", 8), ("[a]", 5)]
                .into_iter()
                .filter(|(_, id)| *id < 5 + n as u32)
                .collect();
            // "[aa]" is the fifth token: before it is added, nothing matches there.
            assert_eq!(found, want, "{n} tokens");
        }
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

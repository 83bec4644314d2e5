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
    by_first_byte: Vec<Vec<AddedToken>>,
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
        let mut by_first_byte: Vec<Vec<AddedToken>> = vec![Vec::new(); 256];
        for (&id, token) in tokenizer.get_added_vocabulary().get_added_tokens_decoder() {
            if token.normalized {
                // Matched inside pieces, after normalization: encoding a piece alone does the same.
                continue;
            }
            if token.lstrip || token.rstrip || token.single_word {
                return None;
            }
            if let Some(&first) = token.content.as_bytes().first() {
                by_first_byte[usize::from(first)].push(AddedToken::new(&token.content, id));
            }
        }
        for tokens in &mut by_first_byte {
            tokens.sort_by_key(|token| std::cmp::Reverse(token.text.len()));
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
                let rest = &bytes[start..];
                let head = head_word(rest);
                if let Some(token) = candidates.iter().find(|token| token.starts(rest, head)) {
                    pos = start + token.text.len();
                    return Some((start..pos, token.id));
                }
                pos = start + 1;
            }
            None
        })
    }
}

/// One added token, with its first bytes as a word to rule out most candidates without a
/// comparison call (Qwen's 26 tokens all start with `<`; a chat has several per prompt).
#[derive(Debug, Clone)]
struct AddedToken {
    /// Its first (up to) eight bytes, little-endian, zero-padded.
    head: u64,
    /// The bits of `head` that hold bytes of the token.
    mask: u64,
    text: Box<str>,
    id: u32,
}

impl AddedToken {
    fn new(text: &str, id: u32) -> Self {
        let len = text.len().min(8);
        Self {
            head: head_word(text.as_bytes()),
            mask: if len == 8 {
                u64::MAX
            } else {
                (1u64 << (8 * len)) - 1
            },
            text: text.into(),
            id,
        }
    }

    /// Whether `rest` (whose [`head_word`] is `head`) starts with the token.
    fn starts(&self, rest: &[u8], head: u64) -> bool {
        head & self.mask == self.head && rest.starts_with(self.text.as_bytes())
    }
}

/// The first (up to) eight bytes of `bytes`, little-endian, zero-padded.
fn head_word(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    let len = bytes.len().min(8);
    word[..len].copy_from_slice(&bytes[..len]);
    u64::from_le_bytes(word)
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

    /// The added tokens `tokens` (JSON entries) found in `text` by the splitter of a
    /// whitespace-pre-tokenized tokenizer, with their ids.
    fn found<'t>(tokens: &[String], text: &'t str) -> Vec<(&'t str, u32)> {
        let t = tokenizer(&tokens.join(","), r#"{"type": "Whitespace"}"#);
        let splitter = AddedTokenSplitter::for_tokenizer(&t).unwrap();
        splitter
            .matches(text)
            .map(|(r, id)| (&text[r], id))
            .collect()
    }

    #[test]
    fn tokens_with_any_number_of_first_bytes_are_found() {
        let contents = ["[a]", "{b}", "#c", "<d>", "[aa]"];
        for n in 1..=contents.len() {
            let tokens: Vec<String> = (0u32..)
                .zip(&contents[..n])
                .map(|(id, content)| added(content, id + 5, false, false))
                .collect();
            let found = found(&tokens, "x[aa]y{b}#c <d>[a]z[a");
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
        let found = found(&tokens, "a<|xy|>b<|x|><|x|>c<y><|x");
        // "<y>" is a normalized token: it is matched inside pieces, not by this pass.
        assert_eq!(found, [("<|xy|>", 2), ("<|x|>", 1), ("<|x|>", 1)]);
    }

    #[test]
    fn tokens_longer_than_a_word_match_whole() {
        let tokens = [
            added("<|im_start|>", 5, false, false),
            added("<|im_starts|>", 6, false, false),
            added("<|im_end|>", 7, false, false),
        ];
        let text = "<|im_start|>a<|im_starts|><|im_stard|><|im_end|<|im_end|><|im_sta";
        assert_eq!(
            found(&tokens, text),
            [("<|im_start|>", 5), ("<|im_starts|>", 6), ("<|im_end|>", 7)]
        );
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

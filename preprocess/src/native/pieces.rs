//! The pre-tokenizer: cuts text into the pieces the Qwen2 / Llama-3 split regex matches, by hand.
//!
//! The regex (`Split` with `Isolated` behaviour; every character is in some match, so the
//! matches tile the text) tries its alternatives leftmost-first at each position:
//!
//! 1. `(?i:'s|'t|'re|'ve|'m|'ll|'d)` — an English contraction, any case (`ſ` folds to `s`);
//! 2. `[^\r\n\p{L}\p{N}]?\p{L}+` — letters, with one preceding character that is not a line
//!    break, letter or number (a space, a tab, punctuation, ...);
//! 3. `\p{N}` (Qwen2) or `\p{N}{1,3}` (Llama-3) — numbers, one or up to three;
//! 4. ` ?[^\s\p{L}\p{N}]+[\r\n]*` — other characters, with an optional leading space and the
//!    line breaks that follow;
//! 5. `\s*[\r\n]+` — whitespace up to and including its last line break;
//! 6. `\s+(?!\S)` — whitespace, all of it at the end of the text, else all but its last
//!    character (which then starts the next piece, as in `" word"`);
//! 7. `\s+` — what is left: a single whitespace character before a non-space.

use super::char_class::{CharClasses, LETTER, NUMBER, SPACE, case_variants};

/// The Qwen2 / Qwen3 split regex.
pub(crate) const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The Llama-3 (GPT-4 `cl100k`-style) split regex: numbers in runs of up to three.
pub(crate) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The contractions after the apostrophe, in the regex's order.
const CONTRACTIONS: [&str; 7] = ["s", "t", "re", "ve", "m", "ll", "d"];

/// Splits text like one of the supported regexes.
#[derive(Debug)]
pub(crate) struct PieceSplitter {
    classes: &'static CharClasses,
    /// Class bits of the ASCII characters.
    ascii: [u8; 128],
    /// Per contraction, per letter: the characters that match it case-insensitively.
    contractions: Vec<Vec<Vec<char>>>,
    /// Numbers per piece: 1 (Qwen2) or 3 (Llama-3).
    max_numbers: usize,
}

impl PieceSplitter {
    /// The splitter for `pattern`, or `None` when it is not one of the supported regexes.
    pub(crate) fn for_pattern(pattern: &str) -> Option<Self> {
        let max_numbers = match pattern {
            QWEN2_PATTERN => 1,
            LLAMA3_PATTERN => 3,
            _ => return None,
        };
        let classes = CharClasses::get()?;
        let mut ascii = [0u8; 128];
        for (b, class) in (0u8..).zip(ascii.iter_mut()) {
            *class = classes.of(char::from(b));
        }
        let contractions = CONTRACTIONS
            .iter()
            .map(|letters| letters.chars().map(case_variants).collect())
            .collect::<Option<_>>()?;
        Some(Self {
            classes,
            ascii,
            contractions,
            max_numbers,
        })
    }

    /// The pieces of `text`, in order; they concatenate to `text`.
    pub(crate) fn pieces<'t>(&'t self, text: &'t str) -> impl Iterator<Item = &'t str> + 't {
        let mut start = 0;
        std::iter::from_fn(move || {
            if start >= text.len() {
                return None;
            }
            let end = self.piece_end(text, start);
            let piece = &text[start..end];
            start = end;
            Some(piece)
        })
    }

    /// The first byte at or after `at` where `text` may be cut so that its two sides split into
    /// exactly the pieces the whole text splits into (and NFC-normalise the same); `None` when
    /// there is none before `at + within`.
    ///
    /// The cut is before a space with an ASCII letter on each side, as in `"word word"`. No
    /// alternative crosses it: letters run (2.) stop at the space, a contraction (1.) ends in a
    /// letter, and the other alternatives cannot start on a letter; so a piece ends right before
    /// the space in the whole text, and one that starts at the space sees only what follows
    /// it. ASCII characters never compose under NFC, so normalising either side alone changes
    /// nothing across the cut.
    pub(crate) fn cut_at_or_after(text: &str, at: usize, within: usize) -> Option<usize> {
        let bytes = text.as_bytes();
        let end = at.saturating_add(within).min(bytes.len().saturating_sub(1));
        (at.max(1)..end).find(|&i| {
            bytes[i] == b' '
                && bytes[i - 1].is_ascii_alphabetic()
                && bytes[i + 1].is_ascii_alphabetic()
        })
    }

    /// The character at byte `at`, its class bits and its length in bytes.
    #[inline]
    fn at(&self, text: &str, at: usize) -> Option<(char, u8, usize)> {
        let b = *text.as_bytes().get(at)?;
        if b < 0x80 {
            return Some((char::from(b), self.ascii[usize::from(b)], 1));
        }
        let c = text[at..].chars().next()?;
        Some((c, self.classes.of(c), c.len_utf8()))
    }

    /// Where the run of characters whose class has `bit`, from byte `at`, ends.
    #[inline]
    fn skip_class(&self, text: &str, mut at: usize, bit: u8) -> usize {
        let bytes = text.as_bytes();
        loop {
            if bit == LETTER {
                at = ascii_letters_end(bytes, at);
            }
            while let Some(&b) = bytes.get(at)
                && b < 0x80
                && self.ascii[usize::from(b)] & bit != 0
            {
                at += 1;
            }
            match self.at(text, at) {
                Some((_, class, len)) if len > 1 && class & bit != 0 => at += len,
                _ => return at,
            }
        }
    }

    /// Where a contraction right after an apostrophe (its letters start at `at`) ends.
    fn contraction_end(&self, text: &str, at: usize) -> Option<usize> {
        'alternatives: for letters in &self.contractions {
            let mut end = at;
            for variants in letters {
                match self.at(text, end) {
                    Some((c, _, len)) if variants.contains(&c) => end += len,
                    _ => continue 'alternatives,
                }
            }
            return Some(end);
        }
        None
    }

    /// Where the piece starting at byte `start` (a character boundary before the end) ends.
    fn piece_end(&self, text: &str, start: usize) -> usize {
        let Some((c, class, len)) = self.at(text, start) else {
            return text.len();
        };
        let next = start + len;
        // 1. A contraction.
        if c == '\''
            && let Some(end) = self.contraction_end(text, next)
        {
            return end;
        }
        // 2. Letters, maybe with one leading character.
        if class & LETTER != 0 {
            return self.skip_class(text, next, LETTER);
        }
        let next_class = self.at(text, next).map(|(_, class, _)| class);
        if c != '\r' && c != '\n' && class & NUMBER == 0 && next_class == Some(LETTER) {
            return self.skip_class(text, next, LETTER);
        }
        // 3. Numbers.
        if class & NUMBER != 0 {
            let mut end = next;
            for _ in 1..self.max_numbers {
                match self.at(text, end) {
                    Some((_, class, len)) if class & NUMBER != 0 => end += len,
                    _ => break,
                }
            }
            return end;
        }
        // 4. Other characters, maybe after one space, then line breaks.
        let others_start = if class == 0 {
            Some(start)
        } else if c == ' ' && next_class == Some(0) {
            Some(next)
        } else {
            None
        };
        if let Some(others_start) = others_start {
            let mut end = others_start;
            while let Some((_, 0, len)) = self.at(text, end) {
                end += len;
            }
            let bytes = text.as_bytes();
            while end < bytes.len() && matches!(bytes[end], b'\r' | b'\n') {
                end += 1;
            }
            return end;
        }
        // 5.-7. Whitespace (`c` is whitespace here).
        debug_assert_eq!(class, SPACE);
        let mut end = start;
        let mut last_start = start;
        let mut after_line_break = None;
        while let Some((c, class, len)) = self.at(text, end) {
            if class & SPACE == 0 {
                break;
            }
            last_start = end;
            end += len;
            if c == '\r' || c == '\n' {
                after_line_break = Some(end);
            }
        }
        if let Some(end) = after_line_break {
            end
        } else if end == text.len() {
            end
        } else if last_start > start {
            last_start
        } else {
            next
        }
    }
}

/// Where the run of ASCII letters (`[A-Za-z]`, the ASCII part of `\p{L}`) from byte `at`
/// ends, or an earlier byte when fewer than eight are left: eight bytes are tested at once,
/// the rest is left to the caller's byte loop. Long prompts spend a third of their
/// tokenization splitting pieces, most of it in runs of letters.
#[inline]
fn ascii_letters_end(bytes: &[u8], mut at: usize) -> usize {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const LOW: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    const CASE: u64 = 0x2020_2020_2020_2020;
    // Added to a byte of at most 0x7f, these carry into its high bit exactly when it is at
    // least b'a' (0x61) and at least b'z' + 1 (0x7b); no sum carries into the next byte.
    const FROM_A: u64 = 0x1f1f_1f1f_1f1f_1f1f;
    const PAST_Z: u64 = 0x0505_0505_0505_0505;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let word = u64::from_le_bytes(chunk.try_into().expect("eight bytes"));
        // Upper case folded to lower; bytes 0x80 and up are ruled out by `!word` below.
        let lower = (word | CASE) & LOW;
        let letters = lower.wrapping_add(FROM_A) & !lower.wrapping_add(PAST_Z) & !word & HIGH;
        if letters != HIGH {
            return at + (!letters & HIGH).trailing_zeros() as usize / 8;
        }
        at += 8;
    }
    at
}

#[cfg(test)]
mod tests {
    use std::sync::LazyLock;

    use proptest::prelude::*;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{
        OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior,
    };

    use super::*;
    use crate::native::test_text::mixed_text;

    /// The pieces Hugging Face `tokenizers` (fancy-regex) cuts `text` into.
    fn reference(pattern: &str, text: &str) -> Vec<String> {
        static SPLITS: LazyLock<Vec<(&str, Split)>> = LazyLock::new(|| {
            [QWEN2_PATTERN, LLAMA3_PATTERN]
                .into_iter()
                .map(|pattern| {
                    let regex = SplitPattern::Regex(pattern.to_owned());
                    let split = Split::new(regex, SplitDelimiterBehavior::Isolated, false);
                    (pattern, split.unwrap())
                })
                .collect()
        });
        let (_, split) = SPLITS.iter().find(|(p, _)| *p == pattern).unwrap();
        let mut pre = PreTokenizedString::from(text);
        split.pre_tokenize(&mut pre).unwrap();
        pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_owned())
            .collect()
    }

    fn native(pattern: &str, text: &str) -> Vec<String> {
        let splitter = PieceSplitter::for_pattern(pattern).unwrap();
        splitter.pieces(text).map(str::to_owned).collect()
    }

    #[test]
    fn whitespace_rules() {
        let cases: &[(&str, &[&str])] = &[
            ("a  b", &["a", " ", " b"]),
            ("a \n b", &["a", " \n", " b"]),
            ("a   ", &["a", "   "]),
            (" \n\n ", &[" \n\n", " "]),
            ("x\t\ty", &["x", "\t", "\ty"]),
            ("a\r\n\r\nb", &["a", "\r\n\r\n", "b"]),
            ("  ,", &[" ", " ,"]),
            ("?!\n\n x", &["?!\n\n", " x"]),
        ];
        for (text, want) in cases {
            assert_eq!(native(QWEN2_PATTERN, text), *want, "{text:?}");
            assert_eq!(reference(QWEN2_PATTERN, text), *want, "{text:?}");
        }
    }

    #[test]
    fn contractions_numbers_and_letters() {
        let cases: &[(&str, &[&str])] = &[
            ("He's", &["He", "'s"]),
            ("WE'LL'Ve'sorry", &["WE", "'LL", "'Ve", "'s", "orry"]),
            ("it'ſ", &["it", "'ſ"]),
            ("'r'x", &["'r", "'x"]),
            ("12345", &["1", "2", "3", "4", "5"]),
            ("hello.world", &["hello", ".world"]),
            ("中文😀ok", &["中文", "😀ok"]),
        ];
        for (text, want) in cases {
            assert_eq!(native(QWEN2_PATTERN, text), *want, "{text:?}");
            assert_eq!(reference(QWEN2_PATTERN, text), *want, "{text:?}");
        }
        assert_eq!(native(LLAMA3_PATTERN, "1234567"), ["123", "456", "7"]);
    }

    #[test]
    fn other_patterns_are_unsupported() {
        assert!(PieceSplitter::for_pattern(r"\w+|\s+").is_none());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn same_pieces_as_fancy_regex(text in mixed_text()) {
            prop_assert_eq!(native(QWEN2_PATTERN, &text), reference(QWEN2_PATTERN, &text));
            prop_assert_eq!(native(LLAMA3_PATTERN, &text), reference(LLAMA3_PATTERN, &text));
        }

        #[test]
        fn a_cut_splits_into_the_same_pieces(left in mixed_text(), right in mixed_text()) {
            let text = format!("{left}ab cd{right}");
            let mut at = 0;
            let mut cuts = 0;
            while let Some(cut) = PieceSplitter::cut_at_or_after(&text, at, text.len()) {
                for pattern in [QWEN2_PATTERN, LLAMA3_PATTERN] {
                    let mut sides = native(pattern, &text[..cut]);
                    sides.extend(native(pattern, &text[cut..]));
                    prop_assert_eq!(sides, reference(pattern, &text));
                }
                cuts += 1;
                at = cut + 1;
            }
            prop_assert!(cuts >= 1);
        }

        #[test]
        fn ascii_letter_runs_end_where_a_byte_scan_ends(
            bytes in proptest::collection::vec(
                prop_oneof![3 => b'A'..=b'Z', 3 => b'a'..=b'z', 1 => any::<u8>()],
                0..40,
            ),
            at in 0usize..40,
        ) {
            let at = at.min(bytes.len());
            let scanned = at + bytes[at..].iter().take_while(|b| b.is_ascii_alphabetic()).count();
            let end = ascii_letters_end(&bytes, at);
            prop_assert!(end >= at && end <= scanned, "{end} outside {at}..={scanned}");
            prop_assert!(end == scanned || bytes.len() - end < 8);
        }

        #[test]
        fn same_pieces_for_any_characters(text in any::<String>()) {
            prop_assert_eq!(native(QWEN2_PATTERN, &text), reference(QWEN2_PATTERN, &text));
        }
    }
}

//! The Unicode classes the pre-tokenizer regex uses — `\p{L}` (letters), `\p{N}` (numbers) and
//! `\s` (White_Space) — and the case-insensitive variants of the contraction letters.
//!
//! They are taken from `regex-syntax`, the parser behind the `regex` crate that `fancy-regex`
//! (Hugging Face `tokenizers`' regex engine) hands these classes to, so the definitions and
//! their Unicode version are exactly the ones the reference tokenizer uses (`char` methods
//! differ: `is_alphabetic` is not `\p{L}`, and std follows a different Unicode version).

use std::sync::LazyLock;

use regex_syntax::hir::{Class, Hir, HirKind};

/// Class bit of `\p{L}`.
pub(crate) const LETTER: u8 = 1;
/// Class bit of `\p{N}`.
pub(crate) const NUMBER: u8 = 2;
/// Class bit of `\s`.
pub(crate) const SPACE: u8 = 4;

/// Characters per block of the two-level table.
const BLOCK: usize = 256;
/// Blocks covering all of Unicode.
const BLOCKS: usize = (char::MAX as usize + 1) / BLOCK;

/// The class bits of every character (none of them: any other character), as a two-level
/// table: a block number per 256 code points, and the distinct blocks (a few hundred).
#[derive(Debug)]
pub(crate) struct CharClasses {
    index: Vec<u16>,
    blocks: Vec<[u8; BLOCK]>,
}

/// The ranges of a pattern that is a single Unicode class, or a single literal character.
fn class_ranges(pattern: &str) -> Option<Vec<(char, char)>> {
    let hir: Hir = regex_syntax::parse(pattern).ok()?;
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => Some(
            class
                .ranges()
                .iter()
                .map(|range| (range.start(), range.end()))
                .collect(),
        ),
        HirKind::Literal(literal) => {
            let text = std::str::from_utf8(&literal.0).ok()?;
            let mut chars = text.chars();
            let c = chars.next()?;
            chars.next().is_none().then(|| vec![(c, c)])
        }
        _ => None,
    }
}

impl CharClasses {
    /// Builds the table from `regex-syntax`'s definitions (a few milliseconds).
    fn build() -> Option<Self> {
        let mut flat = vec![0u8; BLOCKS * BLOCK];
        for (pattern, bit) in [(r"\p{L}", LETTER), (r"\p{N}", NUMBER), (r"\s", SPACE)] {
            for (start, end) in class_ranges(pattern)? {
                for code in u32::from(start)..=u32::from(end) {
                    flat[code as usize] |= bit;
                }
            }
        }
        let mut index = Vec::with_capacity(BLOCKS);
        let mut blocks: Vec<[u8; BLOCK]> = Vec::new();
        let mut numbers = std::collections::HashMap::new();
        for chunk in flat.chunks_exact(BLOCK) {
            let mut block = [0u8; BLOCK];
            block.copy_from_slice(chunk);
            let number = *numbers.entry(block).or_insert_with(|| {
                blocks.push(block);
                blocks.len() - 1
            });
            index.push(u16::try_from(number).ok()?);
        }
        Some(Self { index, blocks })
    }

    /// The shared table, or `None` if `regex-syntax` lacks its Unicode tables.
    pub(crate) fn get() -> Option<&'static Self> {
        static CLASSES: LazyLock<Option<CharClasses>> = LazyLock::new(CharClasses::build);
        CLASSES.as_ref()
    }

    /// The class bits of `c`.
    #[inline]
    pub(crate) fn of(&self, c: char) -> u8 {
        let code = c as usize;
        self.blocks[usize::from(self.index[code / BLOCK])][code % BLOCK]
    }
}

/// The characters a regex matches for `letter` under `(?i)` (Unicode simple case folding:
/// `s` also matches `S` and `ſ`), or `None` if `regex-syntax` lacks its case tables.
pub(crate) fn case_variants(letter: char) -> Option<Vec<char>> {
    let ranges = class_ranges(&format!("(?i:{letter})"))?;
    Some(
        ranges
            .into_iter()
            .flat_map(|(start, end)| start..=end)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn general_categories_not_char_methods() {
        let classes = CharClasses::get().unwrap();
        assert_eq!(classes.of('a'), LETTER);
        assert_eq!(classes.of('中'), LETTER);
        assert_eq!(classes.of('7'), NUMBER);
        assert_eq!(classes.of('½'), NUMBER);
        assert_eq!(classes.of('Ⅻ'), NUMBER); // Nl: numeric, and alphabetic for std
        assert_eq!(classes.of(' '), SPACE);
        assert_eq!(classes.of('\u{3000}'), SPACE);
        assert_eq!(classes.of('\u{85}'), SPACE);
        assert_eq!(classes.of('\u{200b}'), 0); // zero-width space is not White_Space
        // A vowel sign (Mc): alphabetic for std, not \p{L}.
        assert!('\u{93f}'.is_alphabetic());
        assert_eq!(classes.of('\u{93f}'), 0);
        assert_eq!(classes.of('.'), 0);
        assert_eq!(classes.of('😀'), 0);
        assert_eq!(classes.of(char::MAX), 0);
    }

    #[test]
    fn case_variants_follow_unicode_folding() {
        let mut s = case_variants('s').unwrap();
        s.sort_unstable();
        assert_eq!(s, ['S', 's', 'ſ']);
        let mut d = case_variants('d').unwrap();
        d.sort_unstable();
        assert_eq!(d, ['D', 'd']);
    }
}

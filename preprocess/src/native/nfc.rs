//! NFC normalization, with the tables `tokenizers` uses (`unicode-normalization-alignments`),
//! skipped for text that is ASCII or passes the NFC quick check.

use std::borrow::Cow;

use unicode_normalization_alignments::{IsNormalized, UnicodeNormalization, is_nfc_quick};

/// `text` in Unicode Normalization Form C.
pub(crate) fn nfc(text: &str) -> Cow<'_, str> {
    if text.is_ascii() || is_nfc_quick(text.chars()) == IsNormalized::Yes {
        return Cow::Borrowed(text);
    }
    Cow::Owned(text.nfc().map(|(c, _)| c).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn composes_and_skips() {
        assert!(matches!(nfc("plain ascii"), Cow::Borrowed(_)));
        assert!(matches!(nfc("déjà vu 中文"), Cow::Borrowed(_)));
        assert_eq!(nfc("e\u{301}"), "é");
        assert_eq!(nfc("\u{212b}"), "Å");
        assert_eq!(nfc("\u{1100}\u{1161}"), "가");
        assert_eq!(nfc("q\u{307}\u{323}"), "q\u{323}\u{307}");
    }
}

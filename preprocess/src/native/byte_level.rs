//! The byte-level alphabet of GPT-2-style BPE vocabularies: every byte is written as one
//! printable character (`Ġ` for a space, `Ċ` for a newline), so a token is a string of those.
//!
//! The encoder works on raw bytes; this module turns vocabulary strings back into bytes.

/// Whether byte `b` stands for itself in the alphabet (printable Latin-1, not the soft hyphen).
fn is_self_mapped(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff)
}

/// The character of each byte: printable bytes are themselves, the others (control
/// characters, space, DEL, NBSP, soft hyphen) take the characters from U+0100 on, in order.
fn byte_chars() -> [char; 256] {
    let mut chars = ['\0'; 256];
    let mut next_extra = 0x100u32;
    for b in 0..=255u8 {
        let code = if is_self_mapped(b) {
            u32::from(b)
        } else {
            next_extra += 1;
            next_extra - 1
        };
        chars[usize::from(b)] = char::from_u32(code).unwrap_or('\0');
    }
    chars
}

/// The byte a character of the alphabet stands for.
fn char_byte(c: char) -> Option<u8> {
    let code = u32::from(c);
    if let Ok(b) = u8::try_from(code) {
        return is_self_mapped(b).then_some(b);
    }
    let rank = code.checked_sub(0x100)?;
    (0..=255u8)
        .filter(|&b| !is_self_mapped(b))
        .nth(usize::try_from(rank).ok()?)
}

/// Maps byte-level strings back to bytes, and bytes to their one-character strings.
#[derive(Debug)]
pub(crate) struct ByteLevel {
    /// Byte of each code point below 0x144 (the alphabet's range), or `None`.
    bytes: Vec<Option<u8>>,
    chars: [char; 256],
}

impl ByteLevel {
    /// The alphabet.
    pub(crate) fn new() -> Self {
        let chars = byte_chars();
        let end = chars.iter().map(|&c| u32::from(c)).max().unwrap_or(0) + 1;
        let bytes = (0..end)
            .map(|code| char::from_u32(code).and_then(char_byte))
            .collect();
        Self { bytes, chars }
    }

    /// The raw bytes a vocabulary token stands for, or `None` when it holds a character outside
    /// the alphabet (such a token can never come out of byte-level text).
    pub(crate) fn decode(&self, token: &str) -> Option<Vec<u8>> {
        token
            .chars()
            .map(|c| {
                let code = usize::try_from(u32::from(c)).ok()?;
                self.bytes.get(code).copied().flatten()
            })
            .collect()
    }

    /// The one-character token string of byte `b`.
    pub(crate) fn token_of_byte(&self, b: u8) -> String {
        self.chars[usize::from(b)].to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_characters() {
        let level = ByteLevel::new();
        assert_eq!(level.token_of_byte(b' '), "Ġ");
        assert_eq!(level.token_of_byte(b'\n'), "Ċ");
        assert_eq!(level.token_of_byte(b'a'), "a");
        assert_eq!(level.token_of_byte(0xad), "Ń");
        assert_eq!(level.decode("ĠhelloĊ").as_deref(), Some(&b" hello\n"[..]));
        assert_eq!(level.decode("ä½ł").as_deref(), Some("你".as_bytes()));
        assert_eq!(level.decode("日"), None);
    }

    #[test]
    fn every_byte_round_trips() {
        let level = ByteLevel::new();
        for b in 0..=255u8 {
            assert_eq!(level.decode(&level.token_of_byte(b)), Some(vec![b]), "{b}");
        }
    }
}

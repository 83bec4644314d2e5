//! SHA-256 of API keys, as configured (64 hex digits).

use sha2::{Digest, Sha256};

/// A key's SHA-256 digest.
pub(crate) type KeyDigest = [u8; 32];

/// The SHA-256 of `key` as 64 lowercase hex digits (what `auth.keys[].sha256` holds).
pub fn sha256_hex(key: &[u8]) -> String {
    let digest = Sha256::digest(key);
    let mut hex = String::with_capacity(64);
    for byte in digest {
        hex.push(char::from(HEX[usize::from(byte >> 4)]));
        hex.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
    hex
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The digest of `key`.
pub(crate) fn digest(key: &[u8]) -> KeyDigest {
    Sha256::digest(key).into()
}

/// Parses 64 hex digits (either case).
pub(crate) fn parse_sha256_hex(text: &str) -> Option<KeyDigest> {
    let bytes = text.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (out, pair) in digest.iter_mut().zip(bytes.chunks_exact(2)) {
        *out = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(digest)
}

fn nibble(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_matches_a_known_digest() {
        let hex = sha256_hex(b"test");
        assert_eq!(
            hex,
            "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
        );
        assert_eq!(parse_sha256_hex(&hex), Some(digest(b"test")));
        assert_eq!(parse_sha256_hex(&hex.to_uppercase()), Some(digest(b"test")));
        assert_eq!(parse_sha256_hex(&hex[1..]), None);
        assert_eq!(parse_sha256_hex(&hex.replace('9', "g")), None);
    }
}

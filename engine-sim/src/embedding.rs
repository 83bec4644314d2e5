//! Deterministic embeddings: a unit vector seeded by the input tokens.

use crate::hashing::content_seed;
use crate::textgen::WordGenerator;

/// A unit-length vector of `dim` components derived only from `tokens`.
pub(crate) fn embed(tokens: &[u32], dim: usize) -> Vec<f32> {
    let mut rng = WordGenerator::new(content_seed(tokens));
    let mut v: Vec<f64> = (0..dim)
        .map(|_| {
            // 53 random bits mapped to [-1, 1).
            let unit = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            unit * 2.0 - 1.0
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v.into_iter().map(|x| x as f32).collect()
}

/// Standard base64 (with padding) of the little-endian bytes of `values`.
pub(crate) fn to_base64(values: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeddings_are_deterministic_unit_vectors() {
        let a = embed(&[1, 2, 3], 16);
        assert_eq!(a.len(), 16);
        assert_eq!(a, embed(&[1, 2, 3], 16));
        assert_ne!(a, embed(&[1, 2, 4], 16));
        let norm: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5);
    }

    #[test]
    fn base64_matches_known_vectors() {
        // 1.0f32 little-endian = 00 00 80 3F.
        assert_eq!(to_base64(&[1.0]), "AACAPw==");
        assert_eq!(to_base64(&[1.0, 1.0]), "AACAPwAAgD8=");
        assert_eq!(to_base64(&[1.0, 1.0, 1.0]), "AACAPwAAgD8AAIA/");
        assert_eq!(to_base64(&[]), "");
    }
}

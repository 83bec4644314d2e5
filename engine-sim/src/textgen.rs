//! Deterministic generated text: words from a fixed list picked by a PRNG seeded by the prompt.

use std::sync::LazyLock;

use crate::tokenizer::piece_id;

/// The vocabulary of generated text; one word is one generated token.
const WORDS: [&str; 128] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "about", "other",
    "into", "some", "could", "them", "what", "only", "new", "over", "like", "these", "may",
    "first", "then", "do", "any", "now", "such", "our", "out", "also", "two", "many", "very",
    "must", "well", "through", "where", "most", "after", "made", "each", "before", "way", "should",
    "because", "great", "between", "system", "cache", "model", "token", "block", "engine",
    "request", "route", "prefix", "memory", "batch", "queue", "layer", "vector", "stream",
    "signal", "graph", "value", "state", "field", "order", "light", "river", "stone", "cloud",
    "north", "green", "quiet", "rapid", "sharp", "small", "large", "early", "later", "often",
    "never", "always", "again", "bright", "simple",
];

/// Token ids of the words, as the fallback tokenizer would assign them.
static WORD_IDS: LazyLock<Vec<u32>> = LazyLock::new(|| WORDS.iter().map(|w| piece_id(w)).collect());

/// SplitMix64: a tiny, well-mixed PRNG; the same seed always gives the same words.
#[derive(Debug, Clone)]
pub(crate) struct WordGenerator {
    state: u64,
}

impl WordGenerator {
    /// A generator seeded by `seed` (a hash of the prompt tokens).
    pub(crate) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next raw 64-bit value.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The next generated token: its text (without separator) and its token id.
    pub(crate) fn next_word(&mut self) -> (&'static str, u32) {
        // The modulus keeps the index below WORDS.len(), so the cast is lossless.
        let index = (self.next_u64() % WORDS.len() as u64) as usize;
        (WORDS[index], WORD_IDS[index])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_words() {
        let mut a = WordGenerator::new(42);
        let mut b = WordGenerator::new(42);
        let wa: Vec<_> = (0..20).map(|_| a.next_word()).collect();
        let wb: Vec<_> = (0..20).map(|_| b.next_word()).collect();
        assert_eq!(wa, wb);
        let mut c = WordGenerator::new(43);
        let wc: Vec<_> = (0..20).map(|_| c.next_word()).collect();
        assert_ne!(wa, wc);
    }

    #[test]
    fn word_ids_follow_the_fallback_tokenizer() {
        let mut g = WordGenerator::new(7);
        let (word, id) = g.next_word();
        assert_eq!(id, piece_id(word));
    }
}

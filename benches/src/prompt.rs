//! Deterministic synthetic prompts of a requested length in words.

use crate::rng::SplitMix64;

/// Common short English words: each is one token in the usual BPE vocabularies, so a prompt of
/// N words is close to N tokens.
const WORDS: [&str; 64] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "world", "water",
    "light", "house", "river", "stone", "music", "paper", "green", "small", "city", "night",
    "story", "table", "road",
];

/// A prompt of exactly `words` space-separated words, the same for the same `seed`.
pub fn synthetic_prompt(words: usize, seed: u64) -> String {
    let mut rng = SplitMix64::new(seed);
    let mut prompt = String::with_capacity(words * 6);
    for i in 0..words {
        if i > 0 {
            prompt.push(' ');
        }
        prompt.push_str(WORDS[rng.next_index(WORDS.len())]);
    }
    prompt
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn has_the_requested_number_of_words() {
        for n in [0, 1, 16, 1000] {
            assert_eq!(synthetic_prompt(n, 1).split_whitespace().count(), n);
        }
    }

    #[test]
    fn is_deterministic_per_seed() {
        assert_eq!(synthetic_prompt(100, 9), synthetic_prompt(100, 9));
        assert_ne!(synthetic_prompt(100, 9), synthetic_prompt(100, 10));
    }
}

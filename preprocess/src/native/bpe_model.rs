//! A byte-level BPE model: the vocabulary and merge rules of a `tokenizer.json`, encoding one
//! pre-tokenized piece at a time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};

use super::byte_level::ByteLevel;
use super::fast_hash::FastHashMap;
use super::merge::{self, Merge, REMOVED};
use super::piece_cache::PieceCache;

/// `whole` states: not known yet, the piece merges into the token, it does not.
const UNKNOWN: u8 = 0;
const WHOLE: u8 = 1;
const SPLIT: u8 = 2;

/// A vocabulary token.
#[derive(Debug)]
struct VocabEntry {
    id: u32,
    /// Whether merging the token's bytes gives the token itself. Learnt on first use, so that
    /// the common case — a piece that is one token — costs one lookup.
    whole: AtomicU8,
}

/// Tokens of at most this many bytes are keyed by one `u128`.
const SHORT_MAX: usize = 15;

/// Up to 8 bytes as a little-endian `u64`, zero-padded (no memcpy: overlapping reads, OR-ed).
#[inline]
fn load_le(bytes: &[u8]) -> u64 {
    let len = bytes.len();
    let word = |at: usize| {
        let mut word = [0u8; 4];
        word.copy_from_slice(&bytes[at..at + 4]);
        u64::from(u32::from_le_bytes(word))
    };
    if len >= 8 {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[..8]);
        u64::from_le_bytes(word)
    } else if len >= 4 {
        word(0) | (word(len - 4) << ((len - 4) * 8))
    } else if len > 0 {
        let byte = |at: usize| u64::from(bytes[at]) << (at * 8);
        byte(0) | byte(len / 2) | byte(len - 1)
    } else {
        0
    }
}

/// The key of a short byte string: its bytes, zero-padded, and its length in the last byte.
#[inline]
fn short_key(bytes: &[u8]) -> u128 {
    let len = bytes.len();
    let (low, high) = if len > 8 {
        (load_le(bytes), load_le(&bytes[8..]))
    } else {
        (load_le(bytes), 0)
    };
    (u128::from(high | ((len as u64) << 56)) << 64) | u128::from(low)
}

#[inline]
fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// The vocabulary and merges, keyed by raw bytes and token ids.
#[derive(Debug)]
pub(crate) struct BpeModel {
    /// Tokens of up to [`SHORT_MAX`] bytes, by [`short_key`]: no pointer to follow, no memcmp.
    short: FastHashMap<u128, VocabEntry>,
    /// Longer tokens, by their bytes.
    long: FastHashMap<Box<[u8]>, VocabEntry>,
    /// The id of each single byte.
    byte_ids: [u32; 256],
    /// Merges by `(left << 32) | right`.
    merges: FastHashMap<u64, Merge>,
    /// A piece that is a whole token is that token, without merging (`ignore_merges`).
    ignore_merges: bool,
    /// Ids of short pieces that take more than one token.
    cache: PieceCache,
}

impl BpeModel {
    /// Builds the model from the `tokenizer.json` vocabulary (byte-level strings) and merges
    /// (pairs of tokens; the rank is the position, a later duplicate wins as in `tokenizers`).
    /// Fails, with the reason, when a byte has no token or a merge names a missing token.
    pub(crate) fn new<'a>(
        vocab: &HashMap<String, u32>,
        merges: impl IntoIterator<Item = (&'a str, &'a str)>,
        ignore_merges: bool,
    ) -> Result<Self, String> {
        let level = ByteLevel::new();
        let mut byte_ids = [0u32; 256];
        for (b, id) in (0u8..=255).zip(byte_ids.iter_mut()) {
            let token = level.token_of_byte(b);
            *id = *vocab
                .get(&token)
                .ok_or_else(|| format!("byte {b:#04x} ({token:?}) is not in the vocabulary"))?;
        }
        let max_id = vocab.values().copied().max().unwrap_or(0);
        if max_id == REMOVED {
            return Err(format!("token id {max_id} is too large"));
        }
        let id_of = |token: &str| {
            vocab
                .get(token)
                .copied()
                .ok_or_else(|| format!("merge token {token:?} is not in the vocabulary"))
        };
        let mut merge_map = FastHashMap::default();
        let mut merged = String::new();
        for (rank, (left, right)) in merges.into_iter().enumerate() {
            merged.clear();
            merged.push_str(left);
            merged.push_str(right);
            let merge = Merge {
                rank: u32::try_from(rank).map_err(|_| "too many merges".to_owned())?,
                id: id_of(&merged)?,
            };
            merge_map.insert(pair_key(id_of(left)?, id_of(right)?), merge);
        }
        let mut short = FastHashMap::default();
        let mut long = FastHashMap::default();
        for (token, &id) in vocab {
            let Some(bytes) = level.decode(token) else {
                continue;
            };
            let entry = VocabEntry {
                id,
                whole: AtomicU8::new(UNKNOWN),
            };
            if bytes.len() <= SHORT_MAX {
                short.insert(short_key(&bytes), entry);
            } else {
                long.insert(bytes.into_boxed_slice(), entry);
            }
        }
        Ok(Self {
            short,
            long,
            byte_ids,
            merges: merge_map,
            ignore_merges,
            cache: PieceCache::new(),
        })
    }

    /// Appends the ids of one piece (the raw bytes of one pre-tokenizer match) to `out`.
    pub(crate) fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let [b] = piece {
            out.push(self.byte_ids[usize::from(*b)]);
            return;
        }
        let short = (piece.len() <= SHORT_MAX).then(|| short_key(piece));
        let token = match short {
            Some(key) => self.short.get(&key),
            None => self.long.get(piece),
        };
        if let Some(VocabEntry { id, whole }) = token {
            if self.ignore_merges {
                out.push(*id);
                return;
            }
            match whole.load(Ordering::Relaxed) {
                WHOLE => {
                    out.push(*id);
                    return;
                }
                UNKNOWN => {
                    let start = out.len();
                    self.merge(piece, out);
                    let state = if out[start..] == [*id] { WHOLE } else { SPLIT };
                    whole.store(state, Ordering::Relaxed);
                    return;
                }
                _ => {}
            }
        }
        let Some(key) = short else {
            self.merge(piece, out);
            return;
        };
        if self.cache.get(key, out) {
            return;
        }
        let start = out.len();
        self.merge(piece, out);
        self.cache.insert(key, &out[start..]);
    }

    /// Appends the ids of `piece` after the full merge loop.
    fn merge(&self, piece: &[u8], out: &mut Vec<u32>) {
        let pair = |left, right| self.merges.get(&pair_key(left, right)).copied();
        merge::merge(piece, &self.byte_ids, pair, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes as their byte-level tokens, plus "ab", "abc", "bc" and "cab".
    fn model(merges: &[(&str, &str)], ignore_merges: bool) -> BpeModel {
        let level = ByteLevel::new();
        let mut vocab: HashMap<String, u32> = (0..=255u8)
            .map(|b| (level.token_of_byte(b), u32::from(b)))
            .collect();
        for (i, token) in ["ab", "abc", "bc", "cab"].into_iter().enumerate() {
            vocab.insert(token.to_owned(), 256 + i as u32);
        }
        BpeModel::new(&vocab, merges.iter().copied(), ignore_merges).unwrap()
    }

    fn encode(model: &BpeModel, piece: &str) -> Vec<u32> {
        let mut out = Vec::new();
        model.encode_piece(piece.as_bytes(), &mut out);
        out
    }

    #[test]
    fn short_keys_are_the_padded_bytes_and_the_length() {
        let text = b"0123456789abcde";
        for len in 0..=SHORT_MAX {
            let mut padded = [0u8; 16];
            padded[..len].copy_from_slice(&text[..len]);
            padded[SHORT_MAX] = len as u8;
            assert_eq!(
                short_key(&text[..len]),
                u128::from_le_bytes(padded),
                "{len}"
            );
        }
    }

    #[test]
    fn merges_by_rank() {
        let m = model(&[("a", "b"), ("ab", "c"), ("b", "c")], false);
        assert_eq!(encode(&m, "abc"), [257]);
        assert_eq!(
            encode(&m, "abc"),
            [257],
            "second time, from the learnt state"
        );
        assert_eq!(encode(&m, "xbc"), [u32::from(b'x'), 258]);
        assert_eq!(encode(&m, "a"), [u32::from(b'a')]);
        assert_eq!(encode(&m, ""), Vec::<u32>::new());
    }

    #[test]
    fn a_whole_token_is_not_always_reached_by_merging() {
        // "cab" is in the vocabulary but no merge builds it: "c" + "ab".
        let m = model(&[("a", "b")], false);
        assert_eq!(encode(&m, "cab"), [u32::from(b'c'), 256]);
        assert_eq!(encode(&m, "cab"), [u32::from(b'c'), 256]);
        // With ignore_merges a whole token wins.
        let m = model(&[("a", "b")], true);
        assert_eq!(encode(&m, "cab"), [259]);
    }

    #[test]
    fn missing_tokens_are_reported() {
        let level = ByteLevel::new();
        let vocab: HashMap<String, u32> = (0..=255u8)
            .map(|b| (level.token_of_byte(b), u32::from(b)))
            .collect();
        let err = BpeModel::new(&vocab, [("a", "b")], false).unwrap_err();
        assert!(err.contains("\"ab\""), "{err}");
        let mut partial = vocab.clone();
        partial.remove(&level.token_of_byte(b' '));
        let err = BpeModel::new(&partial, [], false).unwrap_err();
        assert!(err.contains("0x20"), "{err}");
    }
}

//! How a text goes through the segment cache: cut into stretches at added tokens, the long
//! pieces between them looked up, and what is left to encode spread over a few threads when
//! there is enough of it (a long prompt never seen before).
//!
//! Stretches tokenize apart (see [`crate::added_token_split`]), and the native encoder may also
//! cut a long piece where its pre-tokenizer would cut it anyway
//! ([`crate::native::NativeEncoder::cut_at_or_after`]); so the threads' ids, put back in order,
//! are the ids of the whole text. Measured with `cargo bench -p kvmesh-proxy --bench route`
//! (the ~128k-token cold chat; docs/BENCHMARKS.md).

use std::ops::Range;
use std::sync::Arc;

use crate::error::Result;
use crate::segment_cache::{MIN_CACHED_BYTES, SegmentCache};

/// A text with at least this many bytes left to encode (≈ 16k tokens, ≈ 0.3 ms of encoding)
/// is spread over threads: starting one costs ≈ 20–50 µs.
pub(crate) const PARALLEL_MIN_BYTES: usize = 64 * 1024;
/// At most this many threads encode one text, so a proxy busy with several long prompts does
/// not start more threads than it has cores to run them.
pub(crate) const MAX_PARTS: usize = 4;
/// A long piece is cut into chunks of about a `CHUNKS_PER_PART`th of a thread's share, so the
/// threads' shares come out about even.
const CHUNKS_PER_PART: usize = 2;
/// How far past the wanted place a cut is looked for before the piece is left whole there.
const CUT_SEARCH_BYTES: usize = 4096;

/// Appends the ids of a text (no post-processing) to a vector.
pub(crate) type Encode<'e> = dyn Fn(&str, &mut Vec<u32>) -> Result<()> + Sync + 'e;
/// Where a text without added tokens may be cut: the first place at or after a byte offset,
/// looking this far.
pub(crate) type Cut = fn(&str, usize, usize) -> Option<usize>;

/// One stretch of the text, in order.
enum Stretch {
    /// Encoded as it is: short pieces and the added tokens between them.
    Direct(Range<usize>),
    /// A long piece whose ids the cache had.
    Hit(Arc<[u32]>),
    /// A long piece to encode, then remember.
    Miss(Range<usize>),
}

/// The stretches of `text`: long pieces between the added tokens that `cache` finds are
/// looked up, everything else (short pieces and the tokens) is encoded in runs.
fn stretches(cache: &SegmentCache, text: &str) -> Vec<Stretch> {
    let mut stretches = Vec::new();
    let mut run_start = 0;
    let mut piece = |piece: Range<usize>, run_start: &mut usize| {
        if piece.len() < MIN_CACHED_BYTES {
            return;
        }
        if *run_start < piece.start {
            stretches.push(Stretch::Direct(*run_start..piece.start));
        }
        stretches.push(match cache.get(&text[piece.clone()]) {
            Some(ids) => Stretch::Hit(ids),
            None => Stretch::Miss(piece.clone()),
        });
        *run_start = piece.end;
    };
    let mut piece_start = 0;
    for (token, _) in cache.splitter.matches(text) {
        piece(piece_start..token.start, &mut run_start);
        piece_start = token.end;
    }
    piece(piece_start..text.len(), &mut run_start);
    if run_start < text.len() {
        stretches.push(Stretch::Direct(run_start..text.len()));
    }
    stretches
}

/// The ranges to encode, in order, and how many of them each stretch has: a missed piece
/// longer than `chunk` bytes is cut (where `cut` allows) into chunks of about that size.
fn jobs(
    text: &str,
    stretches: &[Stretch],
    chunk: usize,
    cut: Option<Cut>,
) -> (Vec<Range<usize>>, Vec<usize>) {
    let mut jobs = Vec::with_capacity(stretches.len());
    let mut per_stretch = Vec::with_capacity(stretches.len());
    for stretch in stretches {
        let before = jobs.len();
        match stretch {
            Stretch::Hit(_) => {}
            Stretch::Direct(range) => jobs.push(range.clone()),
            Stretch::Miss(range) => {
                let mut start = range.start;
                if let Some(cut) = cut {
                    while range.end - start > 2 * chunk
                        && let Some(at) = cut(&text[start..range.end], chunk, CUT_SEARCH_BYTES)
                    {
                        jobs.push(start..start + at);
                        start += at;
                    }
                }
                jobs.push(start..range.end);
            }
        }
        per_stretch.push(jobs.len() - before);
    }
    (jobs, per_stretch)
}

/// The ids of a run of consecutive jobs, and where each job's ids end.
#[derive(Default)]
struct Encoded {
    ids: Vec<u32>,
    ends: Vec<usize>,
}

impl Encoded {
    fn of(text: &str, jobs: &[Range<usize>], encode: &Encode<'_>) -> Result<Self> {
        let bytes: usize = jobs.iter().map(Range::len).sum();
        let mut encoded = Self {
            ids: Vec::with_capacity(bytes / 3),
            ends: Vec::with_capacity(jobs.len()),
        };
        for job in jobs {
            encode(&text[job.clone()], &mut encoded.ids)?;
            encoded.ends.push(encoded.ids.len());
        }
        Ok(encoded)
    }

    /// Each job's ids, in order.
    fn slices(&self) -> impl Iterator<Item = &[u32]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(&self.ends)
            .map(|(start, &end)| &self.ids[start..end])
    }
}

/// Encodes `jobs` in `parts` consecutive runs of about equal bytes, the first on this thread
/// and the others on threads of their own (on this thread too when one cannot be started).
fn encode_jobs(
    text: &str,
    jobs: &[Range<usize>],
    parts: usize,
    encode: &Encode<'_>,
) -> Result<Vec<Encoded>> {
    if parts <= 1 || jobs.len() < 2 {
        return Ok(vec![Encoded::of(text, jobs, encode)?]);
    }
    let total: usize = jobs.iter().map(Range::len).sum();
    let mut runs = Vec::with_capacity(parts);
    let (mut start, mut bytes) = (0, 0);
    for (i, job) in jobs.iter().enumerate() {
        bytes += job.len();
        if bytes * parts >= total * (runs.len() + 1) {
            runs.push(&jobs[start..=i]);
            start = i + 1;
        }
    }
    if start < jobs.len() {
        runs.push(&jobs[start..]);
    }
    std::thread::scope(|scope| {
        let spawned: Vec<_> = runs[1..]
            .iter()
            .map(|run| {
                std::thread::Builder::new()
                    .name("kvmesh-encode".to_owned())
                    .spawn_scoped(scope, move || Encoded::of(text, run, encode))
                    .map_err(|_| run)
            })
            .collect();
        let mut encoded = vec![Encoded::of(text, runs[0], encode)?];
        for thread in spawned {
            encoded.push(match thread {
                Ok(handle) => handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))?,
                Err(run) => Encoded::of(text, run, encode)?,
            });
        }
        Ok(encoded)
    })
}

/// Ids of `text` (no post-processing) through `cache`, with up to `parts` threads when enough
/// is left to encode; `cut` (the native encoder's) lets a long piece be shared between them.
pub(crate) fn encode_cached(
    cache: &SegmentCache,
    text: &str,
    parts: usize,
    encode: &Encode<'_>,
    cut: Option<Cut>,
) -> Result<Vec<u32>> {
    let stretches = stretches(cache, text);
    let pending: usize = stretches
        .iter()
        .map(|stretch| match stretch {
            Stretch::Direct(range) | Stretch::Miss(range) => range.len(),
            Stretch::Hit(_) => 0,
        })
        .sum();
    let parts = if pending >= PARALLEL_MIN_BYTES {
        parts.clamp(1, MAX_PARTS)
    } else {
        1
    };
    let chunk = (pending / (parts * CHUNKS_PER_PART)).max(PARALLEL_MIN_BYTES / CHUNKS_PER_PART);
    let (jobs, per_stretch) = jobs(text, &stretches, chunk, cut.filter(|_| parts > 1));
    let encoded = encode_jobs(text, &jobs, parts, encode)?;
    let mut slices = encoded.iter().flat_map(Encoded::slices);
    let hits: usize = stretches
        .iter()
        .map(|stretch| match stretch {
            Stretch::Hit(ids) => ids.len(),
            _ => 0,
        })
        .sum();
    let mut out = Vec::with_capacity(hits + encoded.iter().map(|e| e.ids.len()).sum::<usize>());
    for (stretch, &count) in stretches.iter().zip(&per_stretch) {
        match stretch {
            Stretch::Hit(ids) => out.extend_from_slice(ids),
            Stretch::Direct(_) => slices
                .by_ref()
                .take(count)
                .for_each(|ids| out.extend_from_slice(ids)),
            Stretch::Miss(range) => {
                let start = out.len();
                slices
                    .by_ref()
                    .take(count)
                    .for_each(|ids| out.extend_from_slice(ids));
                cache.insert(&text[range.clone()], Arc::from(&out[start..]));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::Mutex;

    use super::*;
    use crate::native::NativeEncoder;

    /// `words` words of plain prose.
    fn prose(words: usize) -> String {
        const WORDS: [&str; 6] = ["alpha", "beta", "gamma", "delta", "kv", "mesh"];
        (0..words)
            .map(|i| WORDS[i * 7 % WORDS.len()])
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn a_long_missed_piece_is_cut_into_chunks_that_tile_it() {
        let text = prose(50_000);
        let stretches = [Stretch::Direct(0..10), Stretch::Miss(10..text.len())];
        let chunk = 64 * 1024;
        let (jobs, per_stretch) = jobs(
            &text,
            &stretches,
            chunk,
            Some(NativeEncoder::cut_at_or_after),
        );
        assert_eq!(per_stretch, [1, jobs.len() - 1]);
        assert!(jobs.len() > 3, "{jobs:?}");
        assert_eq!(jobs[0], 0..10);
        for pair in jobs.windows(2) {
            assert_eq!(pair[0].end, pair[1].start);
        }
        assert_eq!(jobs.last().unwrap().end, text.len());
        let (last, chunks) = jobs[1..].split_last().unwrap();
        for job in chunks {
            assert!((chunk..chunk + 16).contains(&job.len()), "{job:?}");
            assert_eq!(&text[job.end..=job.end], " ", "{job:?}");
        }
        assert!((chunk..=2 * chunk).contains(&last.len()), "{last:?}");
        let (uncut, _) = super::jobs(&text, &stretches, chunk, None);
        assert_eq!(uncut, [0..10, 10..text.len()]);
    }

    #[test]
    fn runs_go_to_threads_of_their_own_and_come_back_in_order() {
        let text = "abcdefghij";
        let jobs: Vec<Range<usize>> = (0..10).map(|i| i..i + 1).collect();
        let threads = Mutex::new(HashSet::new());
        let encode = |piece: &str, out: &mut Vec<u32>| {
            threads.lock().unwrap().insert(std::thread::current().id());
            out.push(u32::from(piece.as_bytes()[0]));
            Ok(())
        };
        for parts in 1..=4 {
            threads.lock().unwrap().clear();
            let encoded = encode_jobs(text, &jobs, parts, &encode).unwrap();
            assert_eq!(encoded.len(), parts);
            let ids: Vec<u32> = encoded
                .iter()
                .flat_map(Encoded::slices)
                .flatten()
                .copied()
                .collect();
            assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
            assert_eq!(threads.lock().unwrap().len(), parts);
        }
    }

    #[test]
    fn an_encoding_error_is_returned_from_any_thread() {
        let jobs: Vec<Range<usize>> = (0..4).map(|i| i..i + 1).collect();
        let encode = |piece: &str, out: &mut Vec<u32>| {
            if piece == "d" {
                return Err(crate::error::PreprocessError::Encode("no".to_owned()));
            }
            out.push(0);
            Ok(())
        };
        assert!(encode_jobs("abcd", &jobs, 2, &encode).is_err());
    }
}

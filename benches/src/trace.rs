//! Mooncake (FAST'25) JSONL traces: reading, slicing and expanding hash ids into token ids.
//!
//! One request per line: `{"timestamp": ms, "input_length": n, "output_length": n,
//! "hash_ids": [id, ...]}`. Each hash id stands for one block of `block_size` (512) tokens,
//! prefix-chained: requests that start with the same ids share that prefix. Expansion follows
//! Dynamo's replay: every id becomes `block_size` copies of the token id `id as u32`, the blocks
//! are concatenated and the result is cut to `input_length`.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Tokens each trace hash id stands for in the Mooncake traces.
pub const MOONCAKE_BLOCK_SIZE: usize = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRecord {
    /// Arrival time in milliseconds from an arbitrary origin.
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: usize,
    /// Generated tokens (sent as `max_tokens`).
    pub output_length: u32,
    /// Prefix-chained block ids of the prompt.
    pub hash_ids: Vec<u64>,
}

impl TraceRecord {
    /// Writes the prompt's token ids into `out` (cleared first): `block_size` copies of each
    /// hash id, cut to `input_length`. Ids above `u32::MAX` wrap, as Dynamo's `as u32` does.
    pub fn expand_into(&self, block_size: usize, out: &mut Vec<u32>) {
        out.clear();
        out.reserve(self.input_length);
        for &id in &self.hash_ids {
            let left = self.input_length - out.len();
            if left == 0 {
                break;
            }
            // Truncation is the documented expansion rule.
            out.extend(std::iter::repeat_n(id as u32, block_size.min(left)));
        }
    }
}

/// Which part of a trace to replay.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TraceSlice {
    /// Leave out the requests that arrive sooner than this after the trace's first request; the
    /// slice starts with the first one left (e.g. half the trace's span: its second half).
    pub skip: Option<Duration>,
    /// At most this many requests, from the first.
    pub requests: Option<usize>,
    /// Only requests that arrive within this long of the first one.
    pub span: Option<Duration>,
}

/// Failure to read a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// The trace file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line is not a trace record.
    #[error("{path}:{line}: not a Mooncake trace record: {source}")]
    Parse {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Why it does not parse.
        source: serde_json::Error,
    },
    /// A record claims more tokens than its hash ids cover.
    #[error(
        "{path}:{line}: input_length {input_length} exceeds {blocks} hash ids × {block_size} tokens"
    )]
    ShortHashIds {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The record's input length.
        input_length: usize,
        /// Its number of hash ids.
        blocks: usize,
        /// Tokens per hash id.
        block_size: usize,
    },
    /// Timestamps go backwards.
    #[error("{path}:{line}: timestamp {timestamp} is earlier than the previous line's")]
    Unsorted {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The offending timestamp.
        timestamp: u64,
    },
    /// The slice selects nothing.
    #[error("the trace slice of {0} selects no request")]
    Empty(PathBuf),
}

/// Reads the slice of the trace at `path`; blank lines are skipped.
pub fn read_trace(
    path: &Path,
    slice: TraceSlice,
    block_size: usize,
) -> Result<Vec<TraceRecord>, TraceError> {
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_trace(std::io::BufReader::new(file), path, slice, block_size)
}

/// Parses the slice of a trace from `reader`; `path` names it in errors.
pub fn parse_trace(
    reader: impl BufRead,
    path: &Path,
    slice: TraceSlice,
    block_size: usize,
) -> Result<Vec<TraceRecord>, TraceError> {
    let io = |source| TraceError::Io {
        path: path.to_owned(),
        source,
    };
    let mut records: Vec<TraceRecord> = Vec::new();
    let mut trace_start: Option<u64> = None;
    let mut previous: Option<u64> = None;
    for (i, line) in reader.lines().enumerate() {
        if slice.requests.is_some_and(|n| records.len() >= n) {
            break;
        }
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let record: TraceRecord =
            serde_json::from_str(&line).map_err(|source| TraceError::Parse {
                path: path.to_owned(),
                line: i + 1,
                source,
            })?;
        if record.input_length > record.hash_ids.len() * block_size {
            return Err(TraceError::ShortHashIds {
                path: path.to_owned(),
                line: i + 1,
                input_length: record.input_length,
                blocks: record.hash_ids.len(),
                block_size,
            });
        }
        if previous.is_some_and(|last| record.timestamp < last) {
            return Err(TraceError::Unsorted {
                path: path.to_owned(),
                line: i + 1,
                timestamp: record.timestamp,
            });
        }
        previous = Some(record.timestamp);
        let start = *trace_start.get_or_insert(record.timestamp);
        if slice
            .skip
            .is_some_and(|skip| Duration::from_millis(record.timestamp - start) < skip)
        {
            continue;
        }
        if let Some(first) = records.first() {
            let since_first = Duration::from_millis(record.timestamp - first.timestamp);
            if slice.span.is_some_and(|span| since_first > span) {
                break;
            }
        }
        records.push(record);
    }
    if records.is_empty() {
        return Err(TraceError::Empty(path.to_owned()));
    }
    Ok(records)
}

/// Arrival offsets of `records` from the first one, divided by `time_scale` (2 = twice as fast).
pub fn arrival_offsets(records: &[TraceRecord], time_scale: f64) -> Vec<Duration> {
    let first = records.first().map_or(0, |r| r.timestamp);
    records
        .iter()
        .map(|r| Duration::from_secs_f64((r.timestamp - first) as f64 / 1000.0 / time_scale))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str, slice: TraceSlice) -> Result<Vec<TraceRecord>, TraceError> {
        parse_trace(text.as_bytes(), Path::new("t.jsonl"), slice, 4)
    }

    const TRACE: &str = r#"{"timestamp": 0, "input_length": 5, "output_length": 7, "hash_ids": [3, 4]}
{"timestamp": 0, "input_length": 2, "output_length": 1, "hash_ids": [3]}

{"timestamp": 1500, "input_length": 8, "output_length": 2, "hash_ids": [3, 9]}
{"timestamp": 4000, "input_length": 1, "output_length": 2, "hash_ids": [5]}
"#;

    #[test]
    fn expands_blocks_and_cuts_to_the_input_length() {
        let records = parse(TRACE, TraceSlice::default()).expect("trace");
        assert_eq!(records.len(), 4);
        let mut tokens = Vec::new();
        records[0].expand_into(4, &mut tokens);
        assert_eq!(tokens, [3, 3, 3, 3, 4]);
        records[2].expand_into(4, &mut tokens);
        assert_eq!(tokens, [3, 3, 3, 3, 9, 9, 9, 9]);
        assert_eq!(records[0].output_length, 7);
    }

    #[test]
    fn slices_by_count_and_by_time() {
        let first_two = TraceSlice {
            requests: Some(2),
            ..TraceSlice::default()
        };
        assert_eq!(parse(TRACE, first_two).expect("trace").len(), 2);
        let two_seconds = TraceSlice {
            span: Some(Duration::from_secs(2)),
            ..TraceSlice::default()
        };
        assert_eq!(parse(TRACE, two_seconds).expect("trace").len(), 3);
    }

    #[test]
    fn skips_the_trace_s_start_and_slices_from_the_first_request_left() {
        let after_one_second = TraceSlice {
            skip: Some(Duration::from_secs(1)),
            ..TraceSlice::default()
        };
        let records = parse(TRACE, after_one_second).expect("trace");
        assert_eq!(
            records.iter().map(|r| r.timestamp).collect::<Vec<_>>(),
            [1500, 4000]
        );
        assert_eq!(
            arrival_offsets(&records, 1.0),
            [0, 2500].map(Duration::from_millis).to_vec()
        );
        let one_after = TraceSlice {
            skip: Some(Duration::from_secs(1)),
            requests: Some(1),
            span: None,
        };
        assert_eq!(parse(TRACE, one_after).expect("trace").len(), 1);
        let past_the_end = TraceSlice {
            skip: Some(Duration::from_secs(5)),
            ..TraceSlice::default()
        };
        assert!(matches!(
            parse(TRACE, past_the_end),
            Err(TraceError::Empty(_))
        ));
    }

    #[test]
    fn offsets_follow_timestamps_and_the_time_scale() {
        let records = parse(TRACE, TraceSlice::default()).expect("trace");
        let offsets = arrival_offsets(&records, 2.0);
        assert_eq!(
            offsets,
            [0, 0, 750, 2000].map(Duration::from_millis).to_vec()
        );
    }

    #[test]
    fn rejects_bad_records() {
        let all = TraceSlice::default();
        assert!(matches!(
            parse("{\"timestamp\": 0}\n", all),
            Err(TraceError::Parse { line: 1, .. })
        ));
        let short =
            r#"{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, 2]}"#;
        assert!(matches!(
            parse(short, all),
            Err(TraceError::ShortHashIds { .. })
        ));
        let unsorted = r#"{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1]}
{"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": [1]}"#;
        assert!(matches!(
            parse(unsorted, all),
            Err(TraceError::Unsorted { line: 2, .. })
        ));
        assert!(matches!(parse("\n", all), Err(TraceError::Empty(_))));
        assert!(matches!(
            read_trace(Path::new("/nonexistent/trace"), all, 4),
            Err(TraceError::Io { .. })
        ));
    }
}

//! Data-parallel ranks as vLLM 0.32 serves them behind one API server: the
//! `X-data-parallel-rank` request header, its range check, and the DP load balancer that
//! places a request when no rank is named.
//!
//! - The header is read as vLLM's `_get_data_parallel_rank` reads it
//!   (`vllm/entrypoints/generate/base/serving.py`): Python's `int()` of its value; a value
//!   `int()` refuses is ignored, as if absent. Completions and chat honour it; the Responses
//!   API does not read it (vLLM 0.32 neither).
//! - A rank outside `[0, dp_size)` is refused by `InputProcessor.process_inputs`
//!   (`vllm/v1/engine/input_processor.py`) with a `VLLMValidationError`
//!   `data_parallel_rank {r} is out of range [0, {n}).`: a 400 `BadRequestError`, or, on a
//!   stream, one SSE error event and `[DONE]` after a 200.
//! - Without a rank, `DPLBAsyncMPClient.get_core_engine_for_request`
//!   (`vllm/v1/engine/core_client.py`) picks, per engine request (each prompt and each of
//!   its `n` choices), the core with the lowest `max(in_flight, waiting + running)`, plus
//!   `waiting * 6 * max(0, kv_usage - 0.5)` when requests wait; it scans from a start index
//!   that moves one core on after every choice, so ties go round-robin. vLLM reads waiting
//!   and running from its coordinator's snapshot (every 100 ms) and its own in-flight count;
//!   the simulator reads each core's gauges as of its last iteration and an exact in-flight
//!   count.

use http::HeaderMap;

use super::error::ApiError;
use crate::metrics::BalancerLoad;

/// The request header naming a rank (HTTP header names are case-insensitive).
pub(crate) const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// A rank as the header names it: Python's `int()` of its value, kept as text so a value of
/// any size is reported as vLLM reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestedRank {
    negative: bool,
    /// Decimal digits without leading zeros ("0" for zero).
    digits: String,
}

impl RequestedRank {
    /// The header's rank, if the request has one `int()` accepts.
    pub(crate) fn from_headers(headers: &HeaderMap) -> Option<Self> {
        let value = headers.get(DP_RANK_HEADER)?;
        Self::parse(value.to_str().ok()?)
    }

    /// Python's `int(text)` for base-10 text: surrounding whitespace, an optional sign,
    /// digits with single underscores between them.
    fn parse(text: &str) -> Option<Self> {
        let text = text.trim_matches(|c: char| c.is_ascii_whitespace());
        let (negative, body) = match text.as_bytes().first()? {
            b'-' => (true, &text[1..]),
            b'+' => (false, &text[1..]),
            _ => (false, text),
        };
        let bytes = body.as_bytes();
        let well_formed = bytes.first().is_some_and(u8::is_ascii_digit)
            && bytes.last().is_some_and(u8::is_ascii_digit)
            && bytes.iter().all(|b| b.is_ascii_digit() || *b == b'_')
            && !body.contains("__");
        if !well_formed {
            return None;
        }
        let digits: String = body.chars().filter(char::is_ascii_digit).collect();
        let digits = match digits.trim_start_matches('0') {
            "" => "0".to_owned(),
            significant => significant.to_owned(),
        };
        Some(Self {
            negative: negative && digits != "0",
            digits,
        })
    }

    /// The rank, when it is one of `ranks`; else vLLM's 400.
    pub(crate) fn check(&self, ranks: usize) -> Result<usize, ApiError> {
        match self.digits.parse::<usize>() {
            Ok(rank) if !self.negative && rank < ranks => Ok(rank),
            _ => Err(ApiError::bad_request(out_of_range_message(
                &self.to_string(),
                ranks,
            ))),
        }
    }
}

impl std::fmt::Display for RequestedRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sign = if self.negative { "-" } else { "" };
        write!(f, "{sign}{}", self.digits)
    }
}

/// vLLM's message for a rank outside `[0, ranks)`.
fn out_of_range_message(rank: &str, ranks: usize) -> String {
    format!("data_parallel_rank {rank} is out of range [0, {ranks}).")
}

/// The SSE body vLLM 0.32 streams when a streamed request's rank is refused: the error
/// as `json.dumps` writes it (`", "` and `": "` separators), then `[DONE]`.
pub(crate) fn streamed_error(error: &ApiError) -> String {
    let message = serde_json::to_string(&error.message).unwrap_or_else(|_| "\"\"".to_owned());
    format!(
        "data: {{\"error\": {{\"message\": {message}, \"type\": \"BadRequestError\", \"param\": null, \"code\": {}}}}}\n\ndata: [DONE]\n\n",
        error.status.as_u16()
    )
}

/// Which engine core runs a request's sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RankChoice {
    /// The one the request named.
    Fixed(usize),
    /// The DP load balancer's pick, per sequence.
    Balanced,
}

/// The DP load balancer's pick among cores with `loads` (rank order), scanning from
/// `start`: the lowest score, the first of equals.
pub(crate) fn least_loaded(loads: &[BalancerLoad], start: usize) -> usize {
    let mut best = 0;
    let mut min = f64::INFINITY;
    for i in 0..loads.len() {
        let idx = (start + i) % loads.len();
        let load = loads[idx];
        let mut score = load.in_flight.max(load.waiting + load.running) as f64;
        if load.waiting > 0 {
            score += load.waiting as f64 * 6.0 * (load.kv_usage - 0.5).max(0.0);
        }
        if score < min {
            min = score;
            best = idx;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn parsed(text: &str) -> Option<String> {
        RequestedRank::parse(text).map(|r| r.to_string())
    }

    #[test]
    fn the_header_reads_as_python_int() {
        // What vLLM 0.32 answered for these header values (the report of issue 32 has
        // the run): " 1 " ran on rank 1, "abc" was ignored, "1_0" is 10, "-1" is -1.
        assert_eq!(parsed("1").as_deref(), Some("1"));
        assert_eq!(parsed(" 1 ").as_deref(), Some("1"));
        assert_eq!(parsed("+1").as_deref(), Some("1"));
        assert_eq!(parsed("-1").as_deref(), Some("-1"));
        assert_eq!(parsed("-0").as_deref(), Some("0"));
        assert_eq!(parsed("007").as_deref(), Some("7"));
        assert_eq!(parsed("1_0").as_deref(), Some("10"));
        assert_eq!(
            parsed("123456789012345678901234567890").as_deref(),
            Some("123456789012345678901234567890")
        );
        for ignored in [
            "", " ", "abc", "1.0", "0x1", "1__0", "_1", "1_", "+", "--1", "1 2",
        ] {
            assert_eq!(parsed(ignored), None, "{ignored:?}");
        }
        let mut headers = HeaderMap::new();
        headers.insert("X-Data-Parallel-Rank", HeaderValue::from_static("1"));
        assert_eq!(
            RequestedRank::from_headers(&headers).map(|r| r.to_string()),
            Some("1".to_owned())
        );
    }

    #[test]
    fn out_of_range_ranks_get_vllms_message() {
        let check = |text: &str| RequestedRank::parse(text).map(|r| r.check(2));
        assert_eq!(check("1"), Some(Ok(1)));
        assert_eq!(check("0"), Some(Ok(0)));
        for (text, shown) in [
            ("2", "2"),
            ("-1", "-1"),
            ("1_0", "10"),
            ("99999999999999999999999", "99999999999999999999999"),
        ] {
            let Some(Err(error)) = check(text) else {
                panic!("{text} must be refused");
            };
            assert_eq!(error.status.as_u16(), 400);
            assert_eq!(
                error.message,
                format!("data_parallel_rank {shown} is out of range [0, 2).")
            );
        }
    }

    #[test]
    fn a_streamed_refusal_is_one_error_event_then_done() {
        let error = ApiError::bad_request(out_of_range_message("2", 2));
        // Byte for byte what vLLM 0.32 streamed for `stream: true` with rank 2 of 2.
        assert_eq!(
            streamed_error(&error),
            "data: {\"error\": {\"message\": \"data_parallel_rank 2 is out of range [0, 2).\", \
             \"type\": \"BadRequestError\", \"param\": null, \"code\": 400}}\n\ndata: [DONE]\n\n"
        );
    }

    fn load(in_flight: u64, waiting: u64, running: u64, kv_usage: f64) -> BalancerLoad {
        BalancerLoad {
            in_flight,
            waiting,
            running,
            kv_usage,
        }
    }

    #[test]
    fn the_balancer_takes_the_least_loaded_core_and_rotates_ties() {
        let idle = [load(0, 0, 0, 0.0); 3];
        assert_eq!(least_loaded(&idle, 0), 0);
        assert_eq!(least_loaded(&idle, 1), 1);
        assert_eq!(least_loaded(&idle, 5), 2);
        // The greater of in-flight and waiting + running counts.
        let loads = [load(3, 0, 1, 0.0), load(1, 1, 1, 0.0), load(0, 0, 3, 0.0)];
        assert_eq!(least_loaded(&loads, 0), 1);
        // Waiting requests weigh more on a core whose KV cache is over half full.
        let loads = [load(0, 2, 0, 1.0), load(0, 0, 4, 1.0)];
        assert_eq!(least_loaded(&loads, 0), 1, "2 + 2*6*0.5 = 8 > 4");
        let loads = [load(0, 2, 0, 0.5), load(0, 0, 4, 0.5)];
        assert_eq!(least_loaded(&loads, 0), 0, "no penalty at half usage");
    }
}

//! Prefix-cache results of a run: what the engines saw, against what the oracle could reach.

use serde::Serialize;

use crate::engine_metrics::{EngineDelta, ratio};
use crate::oracle::OracleReport;

/// The fleet's prefix-cache hits during a run, per engine and in total, with the oracle's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheReport {
    /// Each engine's counter differences.
    pub engines: Vec<EngineDelta>,
    /// Prompt tokens the engines looked up.
    pub query_tokens: u64,
    /// Prompt tokens the engines found cached.
    pub hit_tokens: u64,
    /// `hit_tokens / query_tokens`: the fleet's token-weighted hit rate.
    pub hit_rate: f64,
    /// Preemptions over all engines (each re-admission is looked up again).
    pub preemptions: u64,
    /// Fewest requests one engine finished.
    pub requests_min: u64,
    /// Most requests one engine finished.
    pub requests_max: u64,
    /// The oracle's hit rates over the same requests, if computed.
    pub oracle: Option<OracleReport>,
    /// `hit_rate / oracle.hit_rate`, if the oracle was computed and is not 0.
    pub fraction_of_oracle: Option<f64>,
}

impl CacheReport {
    /// Totals of `engines`, compared with `oracle`.
    pub fn new(engines: Vec<EngineDelta>, oracle: Option<OracleReport>) -> Self {
        let query_tokens = engines.iter().map(|e| e.query_tokens).sum();
        let hit_tokens = engines.iter().map(|e| e.hit_tokens).sum();
        let hit_rate = ratio(hit_tokens, query_tokens);
        let fraction_of_oracle = oracle
            .filter(|o| o.hit_rate > 0.0)
            .map(|o| hit_rate / o.hit_rate);
        Self {
            query_tokens,
            hit_tokens,
            hit_rate,
            preemptions: engines.iter().map(|e| e.preemptions).sum(),
            requests_min: engines.iter().map(|e| e.requests).min().unwrap_or(0),
            requests_max: engines.iter().map(|e| e.requests).max().unwrap_or(0),
            engines,
            oracle,
            fraction_of_oracle,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(requests: u64, queries: u64, hits: u64) -> EngineDelta {
        EngineDelta {
            url: "http://e".into(),
            requests,
            query_tokens: queries,
            hit_tokens: hits,
            hit_rate: ratio(hits, queries),
            preemptions: 1,
        }
    }

    fn oracle(hit_rate: f64) -> OracleReport {
        OracleReport {
            model: "m",
            block_size: 64,
            capacity_blocks: 10,
            requests: 3,
            prompt_tokens: 400,
            hit_tokens: 200,
            hit_rate,
            infinite_hit_tokens: 200,
            infinite_hit_rate: hit_rate,
        }
    }

    #[test]
    fn totals_are_token_weighted() {
        let r = CacheReport::new(
            vec![engine(2, 100, 50), engine(1, 300, 50)],
            Some(oracle(0.5)),
        );
        assert_eq!(r.query_tokens, 400);
        assert_eq!(r.hit_tokens, 100);
        assert_eq!(r.hit_rate, 0.25);
        assert_eq!(r.fraction_of_oracle, Some(0.5));
        assert_eq!((r.requests_min, r.requests_max), (1, 2));
        assert_eq!(r.preemptions, 2);
    }

    #[test]
    fn no_oracle_or_a_zero_oracle_gives_no_fraction() {
        assert_eq!(CacheReport::new(vec![], None).fraction_of_oracle, None);
        let zero = CacheReport::new(vec![engine(1, 10, 0)], Some(oracle(0.0)));
        assert_eq!(zero.fraction_of_oracle, None);
        assert_eq!(CacheReport::new(vec![], None).hit_rate, 0.0);
    }
}

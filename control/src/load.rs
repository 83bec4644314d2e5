//! Load reports on NATS (docs/control-plane.md, "NATS: load").

use serde::{Deserialize, Serialize};

use crate::ids::InstanceId;

/// An instance's load, scraped from its engine's `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The reporting instance.
    pub instance_id: InstanceId,
    /// Requests being processed (`vllm:num_requests_running`).
    pub running: u64,
    /// Requests queued (`vllm:num_requests_waiting`).
    pub waiting: u64,
    /// KV cache usage, 0.0 to 1.0 (`vllm:kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// When it was scraped, in Unix milliseconds (on the agent's clock).
    pub at_ms: u64,
    /// How long before it was published the engine was scraped, in milliseconds measured on
    /// the agent's own clock: unlike `at_ms` it needs no clock the proxy shares, so an
    /// agent's clock that runs ahead or behind does not age its reports. Absent (older
    /// agents): the proxy compares `at_ms` with its own clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_ms: Option<u64>,
    /// Whether the agent's view of the engine's KV cache is whole: `false` once KV events
    /// were lost that the engine's replay buffer could not restore (an agent started after
    /// its engine whose buffer no longer reaches back, a gap the replay could not fill),
    /// until the engine clears its cache or restarts. Absent (older agents): whole.
    #[serde(default = "whole")]
    pub events_complete: bool,
    /// The `seq` of the last KV event batch the agent numbered for the instance (published,
    /// or lost on the way: a failed publish, a partition the agent's NATS client could not
    /// see). A proxy whose applied batches stay behind it for a whole report interval
    /// resyncs the gap, even when no later batch comes. Absent (older agents): unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seq: Option<u64>,
}

/// The default of [`LoadReport::events_complete`].
fn whole() -> bool {
    true
}

impl LoadReport {
    /// The report as its JSON payload.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a JSON payload.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_example_parses_and_round_trips() {
        let json = br#"{"instance_id":"00c0ffee00c0ffee","running":3,"waiting":0,"kv_usage":0.42,"at_ms":1732272000000}"#;
        let report = LoadReport::from_json(json).expect("doc example");
        assert_eq!(report.running, 3);
        assert_eq!(report.kv_usage, 0.42);
        assert!(report.events_complete, "an older agent's report: whole");
        let lossy = br#"{"instance_id":"00c0ffee00c0ffee","running":0,"waiting":0,"kv_usage":0,"at_ms":1,"events_complete":false}"#;
        assert!(!LoadReport::from_json(lossy).unwrap().events_complete);
        assert_eq!(report.last_seq, None, "an older agent's report: no seq");
        let numbered = br#"{"instance_id":"00c0ffee00c0ffee","running":0,"waiting":0,"kv_usage":0,"at_ms":1,"last_seq":17}"#;
        assert_eq!(LoadReport::from_json(numbered).unwrap().last_seq, Some(17));
        assert_eq!(
            LoadReport::from_json(&report.to_json()).expect("round trip"),
            report
        );
    }
}

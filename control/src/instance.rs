//! The instance record an agent writes to etcd (docs/control-plane.md, "etcd: instance records").

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::InstanceId;

/// Whether the proxy may route to an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum InstanceState {
    /// The engine is healthy: route to it.
    #[default]
    Ready,
    /// The engine is unhealthy: keep the record, route nothing to it.
    NotReady,
    /// The agent is shutting down: finish in-flight requests, take no new ones.
    Draining,
}

impl InstanceState {
    /// The state's name on the wire (`ready`, `not_ready`, `draining`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::NotReady => "not_ready",
            Self::Draining => "draining",
        }
    }
}

/// The protocol the proxy uses when none is given.
fn default_protocol() -> String {
    "http1".to_owned()
}

/// One engine instance as registered in etcd. Unknown JSON fields are ignored, so records can
/// grow without breaking older readers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceRecord {
    /// The instance's id (16 hex digits on the wire); also its id in the KV index.
    pub instance_id: InstanceId,
    /// The served model name as clients send it.
    pub model: String,
    /// Base URL of the engine's OpenAI-compatible HTTP API, e.g. `http://10.0.0.7:8000`.
    pub url: String,
    /// How to speak to the engine: `http1` (default) or `http2`.
    #[serde(default = "default_protocol")]
    pub protocol: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV cache capacity in blocks (0 when unknown).
    #[serde(default)]
    pub total_blocks: u64,
    /// Number of data-parallel ranks (at least 1).
    #[serde(default = "one")]
    pub dp_ranks: u32,
    /// Free-form labels (zone, GPU kind, ...).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The LoRA adapters the engine serves besides the base model (from its `GET /v1/models`):
    /// a request naming one is routed to the instances that list it, its blocks hashed with
    /// the adapter's seed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
    /// NATS subject of the instance's KV event batches.
    pub event_subject: String,
    /// NATS subject of the instance's resync (snapshot / replay) service.
    pub snapshot_subject: String,
    /// Whether to route to it.
    #[serde(default)]
    pub state: InstanceState,
    /// Its side of disaggregated serving (the agent's `--role`); absent: both.
    #[serde(default, skip_serializing_if = "InstanceRole::is_both")]
    pub role: InstanceRole,
}

/// Which legs of disaggregated requests an instance takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstanceRole {
    /// Prefill and decode legs, and whole requests.
    #[default]
    Both,
    /// Prefill legs only.
    Prefill,
    /// Decode legs and whole requests.
    Decode,
}

impl InstanceRole {
    /// Whether it is [`InstanceRole::Both`] (left out of the record).
    pub fn is_both(&self) -> bool {
        *self == Self::Both
    }
}

fn one() -> u32 {
    1
}

impl InstanceRecord {
    /// The record as the JSON value stored in etcd.
    pub fn to_json(&self) -> Vec<u8> {
        // Serialising plain strings, numbers and maps of strings cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a stored JSON value.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC_EXAMPLE: &str = r#"{
      "instance_id": "00c0ffee00c0ffee",
      "model": "Qwen/Qwen3-0.6B",
      "url": "http://10.0.0.7:8000",
      "protocol": "http1",
      "block_size": 16,
      "total_blocks": 4096,
      "dp_ranks": 1,
      "labels": {"zone": "a"},
      "event_subject": "kvmesh.kv.Qwen%2FQwen3-0%2E6B",
      "snapshot_subject": "kvmesh.snapshot.00c0ffee00c0ffee",
      "state": "ready"
    }"#;

    #[test]
    fn the_documented_record_round_trips() {
        let record = InstanceRecord::from_json(DOC_EXAMPLE.as_bytes()).expect("doc example");
        assert_eq!(record.instance_id, InstanceId(0x00c0_ffee_00c0_ffee));
        assert_eq!(record.labels.get("zone").map(String::as_str), Some("a"));
        assert_eq!(record.state, InstanceState::Ready);
        assert!(record.adapters.is_empty(), "a record without adapters");
        let back = InstanceRecord::from_json(&record.to_json()).expect("round trip");
        assert_eq!(back, record);
        let value: serde_json::Value = serde_json::from_slice(&record.to_json()).expect("json");
        let doc: serde_json::Value = serde_json::from_str(DOC_EXAMPLE).expect("json");
        assert_eq!(value, doc);
    }

    #[test]
    fn adapters_round_trip() {
        let mut value: serde_json::Value = serde_json::from_str(DOC_EXAMPLE).expect("json");
        value["adapters"] = serde_json::json!(["sql-lora", "chat-lora"]);
        let record: InstanceRecord = serde_json::from_value(value).expect("adapters");
        assert_eq!(record.adapters, ["sql-lora", "chat-lora"]);
        let back = InstanceRecord::from_json(&record.to_json()).expect("round trip");
        assert_eq!(back.adapters, record.adapters);
    }

    #[test]
    fn a_role_is_absent_for_both_and_round_trips_otherwise() {
        let record = InstanceRecord::from_json(DOC_EXAMPLE.as_bytes()).expect("doc example");
        assert_eq!(record.role, InstanceRole::Both);
        let mut value: serde_json::Value = serde_json::from_str(DOC_EXAMPLE).expect("json");
        for (text, role) in [
            ("prefill", InstanceRole::Prefill),
            ("decode", InstanceRole::Decode),
        ] {
            value["role"] = text.into();
            let record: InstanceRecord = serde_json::from_value(value.clone()).expect("role");
            assert_eq!(record.role, role);
            let back: serde_json::Value = serde_json::from_slice(&record.to_json()).expect("json");
            assert_eq!(back["role"], text);
        }
        value["role"] = "sideways".into();
        assert!(serde_json::from_value::<InstanceRecord>(value).is_err());
    }

    #[test]
    fn unknown_fields_are_ignored_and_states_parse() {
        let mut value: serde_json::Value = serde_json::from_str(DOC_EXAMPLE).expect("json");
        value["future_field"] = serde_json::json!({"x": 1});
        value["state"] = "not_ready".into();
        let record: InstanceRecord = serde_json::from_value(value.clone()).expect("grows");
        assert_eq!(record.state, InstanceState::NotReady);
        value["state"] = "draining".into();
        let record: InstanceRecord = serde_json::from_value(value.clone()).expect("draining");
        assert_eq!(record.state.as_str(), "draining");
        value["state"] = "bogus".into();
        assert!(serde_json::from_value::<InstanceRecord>(value).is_err());
    }
}

//! What proxy replicas share with each other on NATS (docs/control-plane.md, "NATS:
//! replicas"): session bindings, the in-flight load each one puts on each instance, its
//! routing decisions, and the decisions it asks its model's decider for.

use serde::{Deserialize, Serialize};

use crate::ids::{HexU64, InstanceId};

/// One proxy replica bound a session of a model to an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionShare {
    /// The replica that made the binding (random per proxy process); a replica ignores its
    /// own.
    pub replica: HexU64,
    /// The model.
    pub model: String,
    /// The session key (the value of the model's `kv.session_header`).
    pub session: String,
    /// The instance the session is bound to.
    pub instance_id: InstanceId,
    /// How long the binding lasts from its publication, in milliseconds.
    pub ttl_ms: u64,
}

impl SessionShare {
    /// The binding as its JSON payload.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a JSON payload.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// One proxy replica's in-flight load on one instance, and how fast it learned the instance
/// to be.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct InstanceLoadShare {
    /// The instance.
    pub instance_id: InstanceId,
    /// Prompt tokens of the replica's requests there still in prefill.
    pub prefill_tokens: u64,
    /// KV blocks its requests there hold.
    pub blocks: u64,
    /// Its requests there.
    pub requests: u64,
    /// Its requests there still before their first byte (absent: 0, a replica that does not
    /// share it).
    #[serde(default)]
    pub prefill_requests: u64,
    /// The natural logarithm of the instance's speed factor against the cost model's profile,
    /// as the replica learned it from its own requests' first tokens (absent: 0).
    #[serde(default)]
    pub speed_ln_factor: f64,
    /// The variance of those first tokens' logarithms around it (absent: 0, which the
    /// receiver reads as unknown and assumes its prior spread).
    #[serde(default)]
    pub speed_ln_variance: f64,
    /// The first tokens it learned that from (absent: 0, nothing learned).
    #[serde(default)]
    pub speed_samples: u64,
}

/// One proxy replica's in-flight load on a model's instances, numbered: a newer share
/// replaces the last, and a share counts for `ttl_ms` (a replica that stops sharing, because
/// it died, stops counting).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadShare {
    /// The sharing replica.
    pub replica: HexU64,
    /// Its share number, rising.
    pub seq: u64,
    /// The model.
    pub model: String,
    /// How long the share counts, in milliseconds.
    pub ttl_ms: u64,
    /// Its load per instance (instances without load or learned speed may be left out).
    pub instances: Vec<InstanceLoadShare>,
    /// Every decision it asked the decider for up to this number ([`DecideRequest::seq`]) is
    /// settled: booked in `instances`, or given up. The decider then drops what it booked
    /// for them itself (absent, from older replicas: 0).
    #[serde(default)]
    pub decided: u64,
    /// How many times the replica's load went down up to this share (a first token, a
    /// request's end): the decider holds an ask that saw more until a share shows them
    /// ([`DecideRequest::eased`]; absent, from older replicas: 0).
    #[serde(default)]
    pub eased: u64,
    /// What the replica's own first tokens taught it of how the model's engines split their
    /// prefill time between an iteration's fixed part and its tokens (absent, from older
    /// replicas: nothing learned).
    #[serde(default)]
    pub token_cost: TokenCostShare,
}

/// Weighted sums over a replica's first tokens, from which the model's token factor is
/// fitted (docs/architecture.md, *Learned token factor*): each first token's token share `x`
/// of its profiled time and the ratio `r` of its observed to profiled time, weighted by `w`.
/// Replicas' sums add.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TokenCostShare {
    /// Σ w.
    pub weight: f64,
    /// Σ w·x.
    pub share: f64,
    /// Σ w·r.
    pub ratio: f64,
    /// Σ w·x².
    pub share_squared: f64,
    /// Σ w·x·r.
    pub share_ratio: f64,
}

impl LoadShare {
    /// The share as its JSON payload.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a JSON payload.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// One proxy replica sent a prompt's blocks to an instance (the other replicas count them
/// as predicted there until the engine's KV events take over).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecisionShare {
    /// The deciding replica.
    pub replica: HexU64,
    /// The model.
    pub model: String,
    /// The chosen instance.
    pub instance_id: InstanceId,
    /// Each full block's local hash (kvmesh's hash space), in prompt order.
    pub local: Vec<HexU64>,
    /// Each full block's sequence hash, in prompt order; as long as `local`.
    pub sequence: Vec<HexU64>,
}

impl DecisionShare {
    /// The decision as its JSON payload.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a JSON payload; `local` and `sequence` must be as long as each other.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        let share: Self = serde_json::from_slice(bytes)?;
        check_hashes(&share.local, &share.sequence)?;
        Ok(share)
    }
}

/// Refuses a prompt's local and sequence hashes that differ in length.
fn check_hashes(local: &[HexU64], sequence: &[HexU64]) -> Result<(), serde_json::Error> {
    if local.len() != sequence.len() {
        return Err(serde::de::Error::custom(
            "local and sequence hashes differ in length",
        ));
    }
    Ok(())
}

/// A replica asks its model's decider (the live replica with the lowest id) to choose an
/// instance for one request, so that a burst split over replicas is routed in one order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecideRequest {
    /// The asking replica.
    pub replica: HexU64,
    /// Its number for this request, rising per replica and model.
    pub seq: u64,
    /// How many times the asker's load went down before it asked ([`LoadShare::eased`]):
    /// the decider decides once a share of the asker shows as many, or after a few
    /// milliseconds (absent: 0, no wait).
    #[serde(default)]
    pub eased: u64,
    /// The prompt's tokens.
    pub tokens: u64,
    /// Tokens per block of the hashes.
    pub block_size: u64,
    /// Each full block's local hash, in prompt order.
    pub local: Vec<HexU64>,
    /// Each full block's sequence hash, in prompt order; as long as `local`.
    pub sequence: Vec<HexU64>,
    /// The instances it may use (healthy, not tried yet); the decider chooses among them.
    pub candidates: Vec<InstanceId>,
    /// The request's session key (`kv.session_header`), if any.
    #[serde(default)]
    pub session: Option<String>,
    /// A fingerprint of the asker's `kv` settings for the model; the decider declines when
    /// its own differ (absent: 0, which matches none).
    #[serde(default)]
    pub settings: HexU64,
}

impl DecideRequest {
    /// The request as its JSON payload.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a JSON payload; `local` and `sequence` must be as long as each other.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        let request: Self = serde_json::from_slice(bytes)?;
        check_hashes(&request.local, &request.sequence)?;
        Ok(request)
    }
}

/// The decider's answer: the instance chosen (and booked on the decider until the asking
/// replica's load share shows it), or none, and the asker decides alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecideAnswer {
    /// The chosen instance; absent when the decider did not choose (it does not route the
    /// model, or every candidate is busy or unknown to it).
    #[serde(default)]
    pub instance_id: Option<InstanceId>,
    /// The data-parallel rank to send it to, when the engines' reports name one.
    #[serde(default)]
    pub dp_rank: Option<u32>,
    /// The choice followed the request's session binding (absent: false).
    #[serde(default)]
    pub session_bound: bool,
}

impl DecideAnswer {
    /// The answer as its JSON payload.
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

    const ID: InstanceId = InstanceId(0x00c0_ffee_00c0_ffee);

    #[test]
    fn a_decision_round_trips_and_mismatched_hashes_are_rejected() {
        let json = br#"{"replica":"0000000000000007","model":"m","instance_id":"00c0ffee00c0ffee","local":["0000000000000001","0000000000000002"],"sequence":["00000000000000aa","00000000000000bb"]}"#;
        let share = DecisionShare::from_json(json).expect("doc example");
        assert_eq!(share.sequence[1], HexU64(0xbb));
        assert_eq!(
            DecisionShare::from_json(&share.to_json()).expect("round trip"),
            share
        );
        let uneven = br#"{"replica":"0000000000000007","model":"m","instance_id":"00c0ffee00c0ffee","local":["0000000000000001"],"sequence":[]}"#;
        assert!(DecisionShare::from_json(uneven).is_err());
    }

    #[test]
    fn a_decide_request_and_answer_round_trip() {
        let json = br#"{"replica":"0000000000000007","seq":12,"eased":5,"tokens":130,"block_size":64,"local":["0000000000000001","0000000000000002"],"sequence":["00000000000000aa","00000000000000bb"],"candidates":["00c0ffee00c0ffee"],"session":"chat-42","settings":"5e771465b3a1c0de"}"#;
        let request = DecideRequest::from_json(json).expect("doc example");
        assert_eq!(
            (request.seq, request.eased, request.sequence[1]),
            (12, 5, HexU64(0xbb))
        );
        assert_eq!(
            DecideRequest::from_json(&request.to_json()).expect("round trip"),
            request
        );
        let uneven = br#"{"replica":"0000000000000007","seq":1,"tokens":64,"block_size":64,"local":["0000000000000001"],"sequence":[],"candidates":[]}"#;
        assert!(DecideRequest::from_json(uneven).is_err());
        let older = br#"{"replica":"0000000000000007","seq":1,"tokens":0,"block_size":64,"local":[],"sequence":[],"candidates":[]}"#;
        let older = DecideRequest::from_json(older).expect("an older replica's ask");
        assert_eq!(older.eased, 0, "no wait for its share");
        let answer = DecideAnswer::from_json(br#"{"instance_id":"00c0ffee00c0ffee","dp_rank":1}"#)
            .expect("doc example");
        assert_eq!(answer.instance_id, Some(ID));
        assert_eq!(
            DecideAnswer::from_json(&answer.to_json()).expect("round trip"),
            answer
        );
        assert_eq!(
            DecideAnswer::from_json(b"{}").expect("a decider that did not choose"),
            DecideAnswer::default()
        );
    }

    #[test]
    fn a_load_share_round_trips() {
        let json = br#"{"replica":"0000000000000007","seq":3,"model":"m","ttl_ms":3000,"instances":[{"instance_id":"00c0ffee00c0ffee","prefill_tokens":4096,"blocks":80,"requests":2}]}"#;
        let share = LoadShare::from_json(json).expect("doc example");
        assert_eq!(share.instances[0].prefill_tokens, 4096);
        assert_eq!(
            share.instances[0].prefill_requests, 0,
            "a replica that does not share its queued requests"
        );
        assert_eq!(
            (share.decided, share.eased),
            (0, 0),
            "an older replica's share"
        );
        assert_eq!(
            (
                share.instances[0].speed_ln_factor,
                share.instances[0].speed_samples
            ),
            (0.0, 0),
            "a replica that shares no speed learned nothing"
        );
        assert_eq!(
            LoadShare::from_json(&share.to_json()).expect("round trip"),
            share
        );
        let json = br#"{"replica":"0000000000000007","seq":4,"model":"m","ttl_ms":3000,"decided":2,"eased":9,"instances":[{"instance_id":"00c0ffee00c0ffee","prefill_tokens":0,"blocks":0,"requests":3,"prefill_requests":2,"speed_ln_factor":0.5,"speed_samples":12}]}"#;
        let share = LoadShare::from_json(json).expect("with speed");
        assert_eq!((share.decided, share.eased), (2, 9));
        assert_eq!(share.instances[0].prefill_requests, 2);
        assert_eq!(
            (
                share.instances[0].speed_ln_factor,
                share.instances[0].speed_samples
            ),
            (0.5, 12)
        );
    }

    #[test]
    fn documented_example_parses_and_round_trips() {
        let json = br#"{"replica":"0000000000000007","model":"m","session":"chat-42","instance_id":"00c0ffee00c0ffee","ttl_ms":600000}"#;
        let share = SessionShare::from_json(json).expect("doc example");
        assert_eq!(share.instance_id, InstanceId(0x00c0_ffee_00c0_ffee));
        assert_eq!((share.session.as_str(), share.ttl_ms), ("chat-42", 600_000));
        assert_eq!(
            SessionShare::from_json(&share.to_json()).expect("round trip"),
            share
        );
        assert!(SessionShare::from_json(br#"{"model":"m"}"#).is_err());
    }
}

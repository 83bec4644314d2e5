//! Names of the control plane: etcd keys and NATS subjects under one namespace
//! (docs/control-plane.md).

use std::fmt;

use crate::error::ControlError;
use crate::ids::InstanceId;

/// The namespace used when none is configured.
pub const DEFAULT_NAMESPACE: &str = "kvmesh";

/// Whether `b` must be escaped in a model name inside an etcd key.
fn escape_in_key(b: u8) -> bool {
    b == b'%' || b == b'/'
}

/// Whether `b` must be escaped in a model name used as one NATS subject token.
fn escape_in_subject(b: u8) -> bool {
    escape_in_key(b) || matches!(b, b'.' | b'*' | b'>') || b <= b' ' || b == 0x7F
}

fn percent_encode(model: &str, escape: fn(u8) -> bool) -> String {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(model.len() + 8);
    for c in model.chars() {
        match u8::try_from(c) {
            Ok(b) if escape(b) => {
                out.push('%');
                out.push(char::from(DIGITS[usize::from(b >> 4)]));
                out.push(char::from(DIGITS[usize::from(b & 0xF)]));
            }
            _ => out.push(c),
        }
    }
    out
}

/// Percent-encodes a model name for an etcd key: `/` → `%2F`, `%` → `%25`.
pub fn encode_model_for_key(model: &str) -> String {
    percent_encode(model, escape_in_key)
}

/// Percent-encodes a model name as one NATS subject token: like
/// [`encode_model_for_key`], and `.`, `*`, `>`, spaces and control characters too.
pub fn encode_model_for_subject(model: &str) -> String {
    percent_encode(model, escape_in_subject)
}

/// Reverses either encoding (`%XX` → byte). Fails on a malformed escape or invalid UTF-8.
pub fn decode_model(token: &str) -> Result<String, ControlError> {
    let bad = || ControlError::InvalidName(format!("malformed percent-encoding in {token:?}"));
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).ok_or_else(bad)?;
            // Two hex digits: `from_str_radix` alone would take `%+5` as 0x05.
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return Err(bad());
            }
            let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// A control-plane namespace: the prefix of every etcd key and NATS subject, so several
/// clusters can share one etcd and one NATS. Letters, digits, `_` and `-` only.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace(String);

impl Default for Namespace {
    fn default() -> Self {
        Self(DEFAULT_NAMESPACE.to_owned())
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Namespace {
    /// A namespace; fails unless `name` is non-empty and made of `[A-Za-z0-9_-]`.
    pub fn new(name: &str) -> Result<Self, ControlError> {
        let valid = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if valid {
            Ok(Self(name.to_owned()))
        } else {
            Err(ControlError::InvalidName(format!(
                "namespace {name:?} must be non-empty letters, digits, '_' or '-'"
            )))
        }
    }

    /// The namespace's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `/{ns}/instances/`: the prefix of every instance record.
    pub fn instances_prefix(&self) -> String {
        format!("/{}/instances/", self.0)
    }

    /// `/{ns}/instances/{model}/`: the prefix of one model's instance records.
    pub fn model_prefix(&self, model: &str) -> String {
        format!("/{}/instances/{}/", self.0, encode_model_for_key(model))
    }

    /// `/{ns}/instances/{model}/{instance_id}`: where an instance's record lives.
    pub fn instance_key(&self, model: &str, id: InstanceId) -> String {
        format!("{}{id}", self.model_prefix(model))
    }

    /// Splits an instance key back into (model, instance id); `None` if `key` is not one.
    pub fn parse_instance_key(&self, key: &str) -> Option<(String, InstanceId)> {
        let rest = key.strip_prefix(&self.instances_prefix())?;
        let (model, id) = rest.split_once('/')?;
        if model.is_empty() || id.contains('/') {
            return None;
        }
        Some((decode_model(model).ok()?, id.parse().ok()?))
    }

    /// `{ns}.kv.{model}`: where a model's KV event batches are published.
    pub fn event_subject(&self, model: &str) -> String {
        format!("{}.kv.{}", self.0, encode_model_for_subject(model))
    }

    /// `{ns}.kv.*`: every model's KV event batches.
    pub fn all_events_subject(&self) -> String {
        format!("{}.kv.*", self.0)
    }

    /// `{ns}.snapshot.{instance_id}`: where an agent answers resync requests.
    pub fn snapshot_subject(&self, id: InstanceId) -> String {
        format!("{}.snapshot.{id}", self.0)
    }

    /// `{ns}.load.{model}`: where a model's load reports are published.
    pub fn load_subject(&self, model: &str) -> String {
        format!("{}.load.{}", self.0, encode_model_for_subject(model))
    }

    /// `{ns}.load.*`: every model's load reports.
    pub fn all_load_subject(&self) -> String {
        format!("{}.load.*", self.0)
    }

    /// `{ns}.sessions`: where proxy replicas share their session bindings.
    pub fn sessions_subject(&self) -> String {
        format!("{}.sessions", self.0)
    }

    /// `{ns}.decisions`: where proxy replicas share their routing decisions.
    pub fn decisions_subject(&self) -> String {
        format!("{}.decisions", self.0)
    }

    /// `{ns}.replica_load`: where proxy replicas share their in-flight load.
    pub fn replica_load_subject(&self) -> String {
        format!("{}.replica_load", self.0)
    }

    /// `{ns}.decide.{replica}.{model}`: where proxy replica `replica` (hex) decides for the
    /// other replicas of `model` while it is that model's decider.
    pub fn decide_subject(&self, replica: u64, model: &str) -> String {
        format!(
            "{}.decide.{replica:016x}.{}",
            self.0,
            encode_model_for_subject(model)
        )
    }

    /// `{ns}.key_usage`: where proxy replicas share what their API keys consumed.
    pub fn key_usage_subject(&self) -> String {
        format!("{}.key_usage", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: InstanceId = InstanceId(0x00c0_ffee_00c0_ffee);

    #[test]
    fn keys_and_subjects_follow_the_contract() {
        let ns = Namespace::default();
        let model = "Qwen/Qwen3-0.6B";
        assert_eq!(
            ns.instance_key(model, ID),
            "/kvmesh/instances/Qwen%2FQwen3-0.6B/00c0ffee00c0ffee"
        );
        assert_eq!(ns.event_subject(model), "kvmesh.kv.Qwen%2FQwen3-0%2E6B");
        assert_eq!(ns.load_subject(model), "kvmesh.load.Qwen%2FQwen3-0%2E6B");
        assert_eq!(ns.snapshot_subject(ID), "kvmesh.snapshot.00c0ffee00c0ffee");
        assert_eq!(ns.sessions_subject(), "kvmesh.sessions");
        assert_eq!(ns.replica_load_subject(), "kvmesh.replica_load");
        assert_eq!(ns.decisions_subject(), "kvmesh.decisions");
        assert_eq!(ns.key_usage_subject(), "kvmesh.key_usage");
        assert_eq!(
            ns.decide_subject(7, model),
            "kvmesh.decide.0000000000000007.Qwen%2FQwen3-0%2E6B"
        );
        assert_eq!(ns.instances_prefix(), "/kvmesh/instances/");
        assert_eq!(ns.all_events_subject(), "kvmesh.kv.*");
    }

    #[test]
    fn odd_model_names_round_trip() {
        for model in ["a%2Fb", "x y*z>w.v", "tab\there", "ünïcode/mödel", "plain"] {
            let key = encode_model_for_key(model);
            assert!(!key.contains('/'));
            assert_eq!(decode_model(&key).expect("key token"), model);
            let subject = encode_model_for_subject(model);
            assert!(!subject.contains(['.', '*', '>', ' ', '\t', '/']));
            assert_eq!(decode_model(&subject).expect("subject token"), model);
        }
        assert!(decode_model("bad%2").is_err());
        assert!(decode_model("bad%zz").is_err());
        assert!(decode_model("%FF").is_err());
        // Found by fuzz/ (control_json): an escape is `%` and two hex digits, no sign.
        assert!(decode_model("Z%+05.e").is_err());
    }

    #[test]
    fn instance_keys_parse_back() {
        let ns = Namespace::new("prod-1").expect("valid");
        let key = ns.instance_key("org/model", ID);
        assert_eq!(
            ns.parse_instance_key(&key),
            Some(("org/model".to_owned(), ID))
        );
        assert_eq!(ns.parse_instance_key("/other/instances/m/01"), None);
        assert_eq!(ns.parse_instance_key("/prod-1/instances/m/zz"), None);
        assert_eq!(ns.parse_instance_key("/prod-1/instances/m/01/x"), None);
    }

    #[test]
    fn namespaces_are_validated() {
        for bad in ["", "a.b", "a/b", "a b", "a*"] {
            assert!(Namespace::new(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(Namespace::new("ns_1-x").expect("valid").as_str(), "ns_1-x");
    }
}

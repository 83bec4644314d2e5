//! Identifiers on the wire: 64-bit values as 16-digit lowercase hex strings.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::ControlError;

/// Writes `v` as 16 lowercase hex digits into a stack buffer.
pub(crate) fn hex16(v: u64) -> [u8; 16] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = DIGITS[((v >> (60 - 4 * i)) & 0xF) as usize];
    }
    out
}

/// Parses 1 to 16 hex digits (either case) into a `u64`. Only digits: `from_str_radix` alone
/// would take a leading `+` too.
pub(crate) fn parse_hex(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

/// A `u64` that travels as a 16-digit lowercase hex string (hashes, instance ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct HexU64(pub u64);

impl fmt::Display for HexU64 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl Serialize for HexU64 {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let digits = hex16(self.0);
        // The digits are ASCII, so this never fails.
        serializer.serialize_str(std::str::from_utf8(&digits).unwrap_or_default())
    }
}

struct HexVisitor;

impl Visitor<'_> for HexVisitor {
    type Value = HexU64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a u64 as 1 to 16 hex digits")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<HexU64, E> {
        parse_hex(v)
            .map(HexU64)
            .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
    }
}

impl<'de> Deserialize<'de> for HexU64 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(HexVisitor)
    }
}

/// An instance's id: a `u64`, shown and sent as 16 lowercase hex digits. It is also the
/// instance id of the proxy's KV index (`WorkerKey::instance_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct InstanceId(pub u64);

impl InstanceId {
    /// A random id (never zero).
    pub fn random() -> Self {
        Self(rand::random::<u64>().max(1))
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl FromStr for InstanceId {
    type Err = ControlError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_hex(s).map(Self).ok_or_else(|| {
            ControlError::InvalidName(format!("instance id {s:?} is not 1-16 hex digits"))
        })
    }
}

impl Serialize for InstanceId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        HexU64(self.0).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for InstanceId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        HexU64::deserialize(deserializer).map(|h| Self(h.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_with_16_digits() {
        let json = serde_json::to_string(&HexU64(0xc0ffee)).expect("encode");
        assert_eq!(json, "\"0000000000c0ffee\"");
        let back: HexU64 = serde_json::from_str(&json).expect("decode");
        assert_eq!(back, HexU64(0xc0ffee));
        let max: HexU64 = serde_json::from_str("\"FFFFFFFFFFFFFFFF\"").expect("upper case");
        assert_eq!(max.0, u64::MAX);
        assert!(serde_json::from_str::<HexU64>("\"\"").is_err());
        assert!(serde_json::from_str::<HexU64>("\"10000000000000000\"").is_err());
        assert!(serde_json::from_str::<HexU64>("\"xyz\"").is_err());
        assert!(serde_json::from_str::<HexU64>("12").is_err());
        // Found by fuzz/ (control_json): `from_str_radix` takes a sign.
        assert!(serde_json::from_str::<HexU64>("\"+12\"").is_err());
    }

    #[test]
    fn instance_ids_parse_and_print() {
        let id: InstanceId = "00c0ffee00c0ffee".parse().expect("hex");
        assert_eq!(id.to_string(), "00c0ffee00c0ffee");
        assert!("g".parse::<InstanceId>().is_err());
        // Found by fuzz/ (control_json): a sign is not a hex digit.
        assert!("+424424".parse::<InstanceId>().is_err());
        assert_ne!(InstanceId::random().0, 0);
    }
}

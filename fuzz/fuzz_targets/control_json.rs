//! The other control-plane payloads a proxy or an agent reads from etcd and NATS, chosen by
//! the first byte: instance records (etcd values), load reports, replicas' load, session and
//! decision shares, snapshot requests (NATS), and instance keys with their percent-encoded
//! model names and hex instance ids (etcd keys).
//!
//! Whatever the bytes: nothing panics; what parses writes back to JSON that parses to the same
//! value (floats aside: serde_json reads them back to the nearest value, not always the same
//! bits); an instance key that parses is the key of what it parses to; a model name decodes as
//! RFC 3986 percent-decoding does; an instance id is 1 to 16 hex digits, nothing else.

#![no_main]

use kvmesh_control::{
    DecisionShare, InstanceId, InstanceRecord, LoadReport, LoadShare, Namespace, SessionShare,
    SnapshotRequest, decode_model, encode_model_for_key, encode_model_for_subject,
};
use libfuzzer_sys::fuzz_target;

/// Percent-decoding as RFC 3986 §2.1 writes it: `%` and two hex digits.
fn reference_decode(token: &str) -> Option<String> {
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let pair = bytes.get(i + 1..i + 3)?;
            let digit = |byte: u8| char::from(byte).to_digit(16);
            out.push((digit(pair[0])? * 16 + digit(pair[1])?) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Parses with `from_json`, writes back with `to_json`, and checks that parses to `same`.
macro_rules! round_trip {
    ($type:ty, $data:expr, $same:expr) => {
        if let Ok(value) = <$type>::from_json($data) {
            let again =
                <$type>::from_json(&value.to_json()).expect("what was read is written readable");
            let same: fn(&$type, &$type) -> bool = $same;
            assert!(same(&value, &again), "{value:?} became {again:?}");
        }
    };
}

fuzz_target!(|data: &[u8]| {
    let Some((&choice, data)) = data.split_first() else {
        return;
    };
    match choice % 9 {
        0 => round_trip!(InstanceRecord, data, |a, b| a == b),
        1 => round_trip!(LoadReport, data, |a, b| a.instance_id == b.instance_id),
        2 => round_trip!(LoadShare, data, |a, b| {
            a.replica == b.replica && a.seq == b.seq && a.instances.len() == b.instances.len()
        }),
        3 => round_trip!(SessionShare, data, |a, b| a == b),
        4 => round_trip!(DecisionShare, data, |a, b| a == b),
        5 => round_trip!(SnapshotRequest, data, |a, b| a == b),
        6 => {
            let Ok(key) = std::str::from_utf8(data) else {
                return;
            };
            let namespace = Namespace::default();
            if let Some((model, id)) = namespace.parse_instance_key(key) {
                let written = namespace.instance_key(&model, id);
                assert_eq!(namespace.parse_instance_key(&written), Some((model, id)));
            }
        }
        7 => {
            let Ok(id) = std::str::from_utf8(data) else {
                return;
            };
            let hex_digits =
                (1..=16).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_hexdigit());
            let parsed = id.parse::<InstanceId>();
            assert_eq!(parsed.is_ok(), hex_digits, "{id:?}");
            if let Ok(parsed) = parsed {
                assert_eq!(parsed.to_string().parse::<InstanceId>().ok(), Some(parsed));
            }
        }
        _ => {
            let Ok(token) = std::str::from_utf8(data) else {
                return;
            };
            let decoded = decode_model(token).ok();
            assert_eq!(decoded, reference_decode(token), "{token:?}");
            if let Some(model) = decoded {
                assert_eq!(
                    decode_model(&encode_model_for_key(&model)).ok(),
                    Some(model.clone())
                );
                assert_eq!(
                    decode_model(&encode_model_for_subject(&model)).ok(),
                    Some(model)
                );
            }
        }
    }
});

//! The OpenAI JSON the proxy reads without parsing all of it: a client's request body, of
//! which it reads `model` and `stream` and renames `model` to the model served
//! (`kvmesh_wire::request_fields`: `extract`, `with_model_name`), and an engine's stream
//! chunk, whose one choice a migration's transcript scans (`kvmesh_wire::choice_scan`:
//! `only_choice`, for completions and for chat).
//!
//! Whatever the bytes: nothing panics, and
//! - `extract` calls "not JSON" exactly what serde_json cannot read whole (skipping every
//!   value); of JSON, it reads what a generic reading of the top-level keys finds: an
//!   object whose `model` is absent, `null` or a string and whose `stream` is absent, `null`
//!   or a boolean, neither given twice, with those values; anything else is refused;
//! - the body renamed (to one of a few names: quotes, controls and non-ASCII among them; its
//!   fields read from it or from another copy of it) is the body with one JSON string, the
//!   old model name, replaced by the new name's, every other byte kept; it reads back with
//!   the new name and the same `stream`, and where serde_json reads the body into a `Value`,
//!   the renamed one is the same but for `model`;
//! - when the scan is sure of a chunk that serde_json reads, the chunk has exactly one key
//!   `index` (in any object, a repeated key counted each time it comes) holding the index
//!   scanned, at most one key `text` (`content` for chat) holding the piece scanned (`null`
//!   or `""`: none), and at most one `finish_reason`, a string when the scan says finished
//!   and `null` otherwise.

#![no_main]

use std::fmt;

use bytes::Bytes;
use kvmesh_wire::choice_scan::{Scanned, only_choice};
use kvmesh_wire::request_fields::{FieldsError, extract, with_model_name};
use libfuzzer_sys::fuzz_target;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// The names a body is renamed to (one per input, by its length).
const NAMES: [&str; 5] = [
    "qwen3",
    "",
    "a \"b\" \\c\u{1}\n",
    "mod\u{e9}le-\u{1f980}",
    "model",
];

fuzz_target!(|data: &[u8]| {
    request_fields(data);
    for chat in [false, true] {
        choice_scan(data, chat);
    }
});

/// A JSON object's top-level entries, in order and each as often as it comes, `model`'s and
/// `stream`'s values read generically (the others skipped).
struct TopLevel(Vec<(String, Option<Value>)>);

impl<'de> serde::Deserialize<'de> for TopLevel {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = TopLevel;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TopLevel, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let value = if key == "model" || key == "stream" {
                        Some(map.next_value::<Value>()?)
                    } else {
                        map.next_value::<IgnoredAny>()?;
                        None
                    };
                    entries.push((key, value));
                }
                Ok(TopLevel(entries))
            }
        }
        deserializer.deserialize_map(Entries)
    }
}

fn request_fields(data: &[u8]) {
    let json = serde_json::from_slice::<IgnoredAny>(data).is_ok();
    // Read from the body renamed, as the proxy does, or from another copy of it (the name
    // then found by its key).
    let body = Bytes::copy_from_slice(data);
    let source: &[u8] = if data.len().is_multiple_of(2) {
        &body
    } else {
        data
    };
    let fields = extract(source);
    match &fields {
        Err(FieldsError::InvalidJson(_)) => assert!(!json, "JSON called not JSON"),
        Err(FieldsError::InvalidShape(_)) | Ok(_) => assert!(json, "not JSON read as JSON"),
    }
    // What a generic reading expects: `Some((model, stream))` for a body the proxy takes.
    let expected = serde_json::from_slice::<TopLevel>(data)
        .ok()
        .and_then(|top| {
            let values = |name: &str| -> Vec<Value> {
                (top.0.iter())
                    .filter(|(key, _)| key == name)
                    .filter_map(|(_, value)| value.clone())
                    .collect()
            };
            let (models, streams) = (values("model"), values("stream"));
            let model = match models.as_slice() {
                [] | [Value::Null] => None,
                [Value::String(model)] => Some(model.clone()),
                _ => return None,
            };
            let stream = match streams.as_slice() {
                [] | [Value::Null] => None,
                [Value::Bool(stream)] => Some(*stream),
                _ => return None,
            };
            Some((model, stream))
        });
    let read = fields.as_ref().ok().map(|fields| {
        (
            fields.model.as_ref().map(|m| m.as_str().to_owned()),
            fields.stream,
        )
    });
    assert_eq!(read, expected, "{:?}", String::from_utf8_lossy(data));

    let Ok(fields) = fields else { return };
    let Some(model) = &fields.model else { return };
    let name = NAMES[data.len() % NAMES.len()];
    let renamed = with_model_name(&body, model, name);
    let quoted = serde_json::to_string(name).unwrap();
    // The one string replaced: the same bytes before it and after it.
    let kept_before = data
        .iter()
        .zip(renamed.iter())
        .take_while(|(a, b)| a == b)
        .count();
    let spliced = (0..=kept_before.min(renamed.len().saturating_sub(quoted.len())))
        .filter(|&start| renamed[start..].starts_with(quoted.as_bytes()))
        .find_map(|start| {
            let after = renamed.len() - start - quoted.len();
            let end = data.len().checked_sub(after)?;
            (end >= start && renamed[start + quoted.len()..] == data[end..]).then_some((start, end))
        });
    let Some((start, end)) = spliced else {
        panic!("{renamed:?} is not {data:?} with one value replaced by {quoted}");
    };
    let old: String = serde_json::from_slice(&data[start..end]).expect("a JSON string replaced");
    assert_eq!(old, model.as_str());
    let again = extract(&renamed).expect("the renamed body reads");
    assert_eq!(again.model.as_ref().map(|m| m.as_str()), Some(name));
    assert_eq!(again.stream, fields.stream);
    if let Ok(Value::Object(mut before)) = serde_json::from_slice::<Value>(data) {
        let Ok(Value::Object(mut after)) = serde_json::from_slice::<Value>(&renamed) else {
            panic!("{renamed:?} no longer reads");
        };
        assert_eq!(after.remove("model"), Some(Value::from(name)));
        before.remove("model");
        assert_eq!(after, before);
    }
}

/// A JSON document read generically, every key kept as often as it comes (a `Value` keeps
/// the last one only).
#[derive(Debug)]
enum Json {
    Scalar(Value),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl<'de> serde::Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Any;
        impl<'de> Visitor<'de> for Any {
            type Value = Json;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("JSON")
            }
            fn visit_unit<E>(self) -> Result<Json, E> {
                Ok(Json::Scalar(Value::Null))
            }
            fn visit_bool<E>(self, value: bool) -> Result<Json, E> {
                Ok(Json::Scalar(Value::from(value)))
            }
            fn visit_u64<E>(self, value: u64) -> Result<Json, E> {
                Ok(Json::Scalar(Value::from(value)))
            }
            fn visit_i64<E>(self, value: i64) -> Result<Json, E> {
                Ok(Json::Scalar(Value::from(value)))
            }
            fn visit_f64<E>(self, value: f64) -> Result<Json, E> {
                Ok(Json::Scalar(Value::from(value)))
            }
            fn visit_str<E>(self, value: &str) -> Result<Json, E> {
                Ok(Json::Scalar(Value::from(value)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Json::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry()? {
                    entries.push(entry);
                }
                Ok(Json::Object(entries))
            }
        }
        deserializer.deserialize_any(Any)
    }
}

fn choice_scan(data: &[u8], chat: bool) {
    let Scanned::Choice {
        index,
        piece,
        finished,
    } = only_choice(data, chat)
    else {
        return;
    };
    if let Some(piece) = piece {
        assert!(!piece.is_empty());
        let range = data.as_ptr_range();
        assert!(
            range.contains(&piece.as_ptr()),
            "the piece is the data's own"
        );
    }
    let Ok(json) = serde_json::from_slice::<Json>(data) else {
        return;
    };
    let scalars = |name: &str| -> Vec<&Value> {
        keys(&json, name)
            .into_iter()
            .map(|value| match value {
                Json::Scalar(value) => value,
                other => panic!("{name} scanned, {other:?} found"),
            })
            .collect()
    };
    let indexes = scalars("index");
    let [found] = indexes.as_slice() else {
        panic!("scanned index {index}, found {indexes:?} in {json:?}");
    };
    assert_eq!(found.as_u64(), Some(index as u64), "{json:?}");
    let field = if chat { "content" } else { "text" };
    let expected_piece = match scalars(field).as_slice() {
        [] | [Value::Null] => None,
        [Value::String(text)] => Some(text.as_str()).filter(|text| !text.is_empty()),
        other => panic!("scanned piece {piece:?}, found {other:?} in {json:?}"),
    };
    assert_eq!(piece, expected_piece, "{json:?}");
    let expected_finished = match scalars("finish_reason").as_slice() {
        [] | [Value::Null] => false,
        [Value::String(_)] => true,
        other => panic!("scanned finished {finished}, found {other:?} in {json:?}"),
    };
    assert_eq!(finished, expected_finished, "{json:?}");
}

/// The values of every key `name` in `json`'s objects, however deep.
fn keys<'j>(json: &'j Json, name: &str) -> Vec<&'j Json> {
    let mut found = Vec::new();
    let mut open = vec![json];
    while let Some(json) = open.pop() {
        match json {
            Json::Object(entries) => {
                for (key, value) in entries {
                    if key == name {
                        found.push(value);
                    }
                    open.push(value);
                }
            }
            Json::Array(items) => open.extend(items),
            Json::Scalar(_) => {}
        }
    }
    found
}

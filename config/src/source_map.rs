//! Maps field paths to positions in the YAML text and back.
//!
//! The typed config is deserialized without locations (so it stays a plain
//! struct); this untyped, position-annotated tree of the same text is used to
//! place validation errors on a line and to name the field a parse error is in.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::{Location, Spanned};

use crate::field_path::Segment;
use crate::{FieldPath, TextPosition};

/// The position-annotated shape of a YAML document.
pub(crate) struct SourceMap {
    root: Spanned<Node>,
}

enum Node {
    Map(Vec<(Spanned<String>, Spanned<Node>)>),
    Seq(Vec<Spanned<Node>>),
    Scalar,
}

impl SourceMap {
    /// Parses `text`; `None` when it is not valid YAML.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        serde_saphyr::from_str::<Spanned<Node>>(text)
            .ok()
            .map(|root| Self { root })
    }

    /// Position of the value at `path`, or of its deepest ancestor present in the
    /// text (a defaulted field has no text of its own).
    pub(crate) fn position_of(&self, path: &FieldPath) -> Option<TextPosition> {
        let mut node = &self.root;
        let mut best = position(&node.referenced);
        for segment in path.segments() {
            let next = match (&node.value, segment) {
                (Node::Map(entries), Segment::Key(key)) => entries
                    .iter()
                    .find(|(k, _)| k.value == *key)
                    .map(|(_, value)| value),
                (Node::Seq(items), Segment::Index(index)) => items.get(*index),
                _ => None,
            };
            match next {
                Some(next) => {
                    node = next;
                    best = position(&node.referenced).or(best);
                }
                None => break,
            }
        }
        best
    }

    /// The field whose key or value starts last at or before `position`; on a tie
    /// the enclosing node wins (a mapping starts where its first key does).
    pub(crate) fn path_at(&self, position: TextPosition) -> Option<FieldPath> {
        let mut best: Option<(TextPosition, FieldPath)> = None;
        visit(&self.root, FieldPath::root(), position, &mut best);
        best.map(|(_, path)| path)
    }
}

fn visit(
    node: &Spanned<Node>,
    path: FieldPath,
    target: TextPosition,
    best: &mut Option<(TextPosition, FieldPath)>,
) {
    consider(position(&node.referenced), &path, target, best);
    match &node.value {
        Node::Map(entries) => {
            for (key, value) in entries {
                let child = path.key(&key.value);
                consider(position(&key.referenced), &child, target, best);
                visit(value, child, target, best);
            }
        }
        Node::Seq(items) => {
            for (index, item) in items.iter().enumerate() {
                visit(item, path.index(index), target, best);
            }
        }
        Node::Scalar => {}
    }
}

fn consider(
    candidate: Option<TextPosition>,
    path: &FieldPath,
    target: TextPosition,
    best: &mut Option<(TextPosition, FieldPath)>,
) {
    let Some(candidate) = candidate else { return };
    let key = |p: TextPosition| (p.line, p.column);
    if key(candidate) > key(target) {
        return;
    }
    if best
        .as_ref()
        .is_none_or(|(current, _)| key(candidate) > key(*current))
    {
        *best = Some((candidate, path.clone()));
    }
}

/// A known position (`Location::UNKNOWN` has line 0).
pub(crate) fn position(location: &Location) -> Option<TextPosition> {
    (location.line() > 0).then(|| TextPosition {
        line: location.line(),
        column: location.column(),
    })
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_i128<E: de::Error>(self, _: i128) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_u128<E: de::Error>(self, _: u128) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_none<E: de::Error>(self) -> Result<Node, E> {
        Ok(Node::Scalar)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Node, D::Error> {
        Node::deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<Node>>()? {
            items.push(item);
        }
        Ok(Node::Seq(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Spanned<String>>()? {
            let value = map.next_value::<Spanned<Node>>()?;
            entries.push((key, value));
        }
        Ok(Node::Map(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
listeners:
  - name: main
    address: 127.0.0.1:8080
models:
  - name: a
    backends:
      - url: http://127.0.0.1:1
      - url: x
";

    fn pos(line: u64, column: u64) -> TextPosition {
        TextPosition { line, column }
    }

    #[test]
    fn finds_the_value_of_a_path() {
        let map = SourceMap::parse(TEXT).unwrap();
        let url = FieldPath::root()
            .key("models")
            .index(0)
            .key("backends")
            .index(1)
            .key("url");
        assert_eq!(map.position_of(&url), Some(pos(8, 14)));
        let name = FieldPath::root().key("listeners").index(0).key("name");
        assert_eq!(map.position_of(&name), Some(pos(2, 11)));
    }

    #[test]
    fn a_missing_field_falls_back_to_its_parent() {
        let map = SourceMap::parse(TEXT).unwrap();
        let missing = FieldPath::root().key("models").index(0).key("policy");
        let model = FieldPath::root().key("models").index(0);
        assert_eq!(map.position_of(&missing), map.position_of(&model));
        assert!(map.position_of(&missing).is_some());
    }

    #[test]
    fn names_the_field_at_a_position() {
        let map = SourceMap::parse(TEXT).unwrap();
        assert_eq!(
            map.path_at(pos(8, 14)).unwrap().to_string(),
            "models[0].backends[1].url"
        );
        assert_eq!(
            map.path_at(pos(3, 5)).unwrap().to_string(),
            "listeners[0].address"
        );
    }

    #[test]
    fn invalid_yaml_has_no_map() {
        assert!(SourceMap::parse("a: [1, 2").is_none());
    }
}

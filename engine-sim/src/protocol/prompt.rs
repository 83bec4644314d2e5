//! The four accepted prompt shapes: a string, a list of strings, a list of token ids, or a list
//! of token-id lists (OpenAI `prompt` / `input`).

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};

/// A parsed prompt field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PromptInput {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

const EXPECTED: &str =
    "a string, a list of strings, a list of token ids, or a list of token-id lists";

/// One element of a prompt list.
enum Item {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

struct ItemVisitor;

impl<'de> Visitor<'de> for ItemVisitor {
    type Value = Item;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, a token id (0..=4294967295) or a list of token ids")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
        u32::try_from(v)
            .map(Item::Token)
            .map_err(|_| E::custom(format!("token id {v} is out of range")))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item, E> {
        u32::try_from(v)
            .map(Item::Token)
            .map_err(|_| E::custom(format!("token id {v} is out of range")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Item, E> {
        Ok(Item::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Item, E> {
        Ok(Item::Text(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(id) = seq.next_element::<u32>()? {
            out.push(id);
        }
        Ok(Item::Tokens(out))
    }
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ItemVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = PromptInput;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(EXPECTED)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptInput, E> {
        Ok(PromptInput::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<PromptInput, E> {
        Ok(PromptInput::Text(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptInput, A::Error> {
        let mixed = || {
            de::Error::custom(format!(
                "prompt list mixes element types; expected {EXPECTED}"
            ))
        };
        let mut prompt = match seq.next_element::<Item>()? {
            None => return Ok(PromptInput::Tokens(Vec::new())),
            Some(Item::Text(t)) => PromptInput::Texts(vec![t]),
            Some(Item::Token(t)) => PromptInput::Tokens(vec![t]),
            Some(Item::Tokens(t)) => PromptInput::TokenLists(vec![t]),
        };
        while let Some(item) = seq.next_element::<Item>()? {
            match (&mut prompt, item) {
                (PromptInput::Texts(v), Item::Text(t)) => v.push(t),
                (PromptInput::Tokens(v), Item::Token(t)) => v.push(t),
                (PromptInput::TokenLists(v), Item::Tokens(t)) => v.push(t),
                _ => return Err(mixed()),
            }
        }
        Ok(prompt)
    }
}

impl<'de> Deserialize<'de> for PromptInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<PromptInput, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn every_shape_parses() {
        assert_eq!(parse(r#""hi""#).ok(), Some(PromptInput::Text("hi".into())));
        assert_eq!(
            parse(r#"["a","b"]"#).ok(),
            Some(PromptInput::Texts(vec!["a".into(), "b".into()]))
        );
        assert_eq!(
            parse("[1,2,4294967295]").ok(),
            Some(PromptInput::Tokens(vec![1, 2, u32::MAX]))
        );
        assert_eq!(
            parse("[[1],[2,3]]").ok(),
            Some(PromptInput::TokenLists(vec![vec![1], vec![2, 3]]))
        );
        assert_eq!(parse("[]").ok(), Some(PromptInput::Tokens(vec![])));
    }

    #[test]
    fn bad_shapes_are_rejected() {
        for bad in [
            r#"["a",1]"#,
            "[1,[2]]",
            "[-1]",
            "[4294967296]",
            "[1.5]",
            "42",
            "{}",
            "null",
            "[[\"a\"]]",
        ] {
            assert!(parse(bad).is_err(), "{bad} should fail");
        }
    }
}

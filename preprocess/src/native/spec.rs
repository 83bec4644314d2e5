//! Reading a `tokenizer.json` and deciding whether the native encoder supports it exactly.
//!
//! Supported: normalizer none or NFC; pre-tokenizer `Sequence[Split(<Qwen2 or Llama-3 regex>,
//! Isolated), ByteLevel(add_prefix_space=false, use_regex=false)]`; model BPE without dropout,
//! without word prefix or suffix, with a token for every byte (so neither the unknown token nor
//! byte fallback can ever apply). Anything else is left to Hugging Face `tokenizers`.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{Value, json};

use super::pieces::PieceSplitter;

/// The parts of `tokenizer.json` the decision needs.
#[derive(Deserialize)]
struct TokenizerFile {
    #[serde(default)]
    normalizer: Value,
    #[serde(default)]
    pre_tokenizer: Value,
    model: ModelFile,
}

/// The `model` object of `tokenizer.json`.
#[derive(Deserialize)]
struct ModelFile {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    dropout: Option<f64>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
    #[serde(default)]
    ignore_merges: bool,
    #[serde(default)]
    vocab: HashMap<String, u32>,
    #[serde(default)]
    merges: Vec<MergeEntry>,
}

/// A merge: `["a", "b"]` in newer files, `"a b"` in older ones.
#[derive(Deserialize)]
#[serde(untagged)]
enum MergeEntry {
    Pair(String, String),
    Line(String),
}

/// What the native encoder needs from a supported `tokenizer.json`.
pub(crate) struct NativeSpec {
    /// Whether pieces between added tokens are NFC-normalized first.
    pub(crate) nfc: bool,
    /// The pre-tokenizer.
    pub(crate) splitter: PieceSplitter,
    /// The model's vocabulary (byte-level strings).
    pub(crate) vocab: HashMap<String, u32>,
    /// The merges, in rank order.
    pub(crate) merges: Vec<(String, String)>,
    /// BPE `ignore_merges`.
    pub(crate) ignore_merges: bool,
}

/// Whether the normalizer is NFC (`Some(true)`), none (`Some(false)`), or unsupported.
fn normalizer_is_nfc(normalizer: &Value) -> Option<bool> {
    match normalizer {
        Value::Null => Some(false),
        n if *n == json!({"type": "NFC"}) => Some(true),
        _ => None,
    }
}

/// The splitter for a supported pre-tokenizer.
fn pre_tokenizer_splitter(pre_tokenizer: &Value) -> Option<PieceSplitter> {
    if pre_tokenizer.get("type")? != "Sequence" {
        return None;
    }
    let [split, byte_level] = pre_tokenizer.get("pretokenizers")?.as_array()?.as_slice() else {
        return None;
    };
    let split_ok = split.get("type")? == "Split"
        && split.get("behavior")? == "Isolated"
        && split.get("invert").is_none_or(|invert| *invert == false);
    let byte_level_ok = byte_level.get("type")? == "ByteLevel"
        && *byte_level.get("add_prefix_space")? == false
        && *byte_level.get("use_regex")? == false;
    if !split_ok || !byte_level_ok {
        return None;
    }
    PieceSplitter::for_pattern(split.get("pattern")?.get("Regex")?.as_str()?)
}

impl NativeSpec {
    /// Reads `json` (the text of a `tokenizer.json`); `Err` says why the native encoder does
    /// not support it.
    pub(crate) fn parse(json: &str) -> Result<Self, String> {
        let file: TokenizerFile = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let nfc = normalizer_is_nfc(&file.normalizer)
            .ok_or_else(|| format!("normalizer {} is not supported", file.normalizer))?;
        let splitter = pre_tokenizer_splitter(&file.pre_tokenizer)
            .ok_or_else(|| format!("pre-tokenizer {} is not supported", file.pre_tokenizer))?;
        let model = file.model;
        if model.kind.as_deref() != Some("BPE") {
            return Err(format!("model type {:?} is not BPE", model.kind));
        }
        if model.dropout.is_some_and(|p| p != 0.0) {
            return Err("BPE dropout is not supported".to_owned());
        }
        if !model
            .continuing_subword_prefix
            .unwrap_or_default()
            .is_empty()
            || !model.end_of_word_suffix.unwrap_or_default().is_empty()
        {
            return Err("BPE word prefixes and suffixes are not supported".to_owned());
        }
        let merges = model
            .merges
            .into_iter()
            .map(|merge| match merge {
                MergeEntry::Pair(left, right) => Ok((left, right)),
                MergeEntry::Line(line) => match line.split(' ').collect::<Vec<_>>().as_slice() {
                    [left, right] => Ok(((*left).to_owned(), (*right).to_owned())),
                    _ => Err(format!("malformed merge {line:?}")),
                },
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            nfc,
            splitter,
            vocab: model.vocab,
            merges,
            ignore_merges: model.ignore_merges,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::pieces::QWEN2_PATTERN;

    fn file(normalizer: Value, pattern: &str, byte_level: Value, model: Value) -> String {
        json!({
            "normalizer": normalizer,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                byte_level]},
            "model": model,
        })
        .to_string()
    }

    fn byte_level() -> Value {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false})
    }

    fn bpe() -> Value {
        json!({"type": "BPE", "dropout": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
               "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"], "b a"]})
    }

    #[test]
    fn qwen_shape_is_supported() {
        let spec = NativeSpec::parse(&file(
            json!({"type": "NFC"}),
            QWEN2_PATTERN,
            byte_level(),
            bpe(),
        ))
        .unwrap();
        assert!(spec.nfc);
        assert!(!spec.ignore_merges);
        assert_eq!(spec.merges[1], ("b".to_owned(), "a".to_owned()));
        let spec =
            NativeSpec::parse(&file(Value::Null, QWEN2_PATTERN, byte_level(), bpe())).unwrap();
        assert!(!spec.nfc);
    }

    #[test]
    fn other_shapes_are_refused_with_a_reason() {
        let cases = [
            file(json!({"type": "NFKC"}), QWEN2_PATTERN, byte_level(), bpe()),
            file(Value::Null, r"\w+", byte_level(), bpe()),
            file(
                Value::Null,
                QWEN2_PATTERN,
                json!({"type": "ByteLevel", "add_prefix_space": true, "use_regex": false}),
                bpe(),
            ),
            file(
                Value::Null,
                QWEN2_PATTERN,
                byte_level(),
                json!({"type": "WordPiece"}),
            ),
            file(
                Value::Null,
                QWEN2_PATTERN,
                byte_level(),
                json!({"type": "BPE", "dropout": 0.1, "vocab": {}, "merges": []}),
            ),
            file(
                Value::Null,
                QWEN2_PATTERN,
                byte_level(),
                json!({"type": "BPE", "continuing_subword_prefix": "##", "vocab": {}, "merges": []}),
            ),
        ];
        for json in cases {
            let err = NativeSpec::parse(&json)
                .err()
                .unwrap_or_else(|| panic!("accepted {json}"));
            assert!(!err.is_empty());
        }
    }
}

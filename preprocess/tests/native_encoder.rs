//! Differential tests: the native encoder must give exactly the ids of Hugging Face
//! `tokenizers` for the Qwen3 tokenizer (and for a Llama-3-shaped variant of it), on random
//! mixed-script text, whitespace corner cases, long pieces and chat-template renders.
//!
//! Needs the tokenizer fetched by `scripts/fetch-tokenizer.sh` (or `KVMESH_QWEN3_TOKENIZER`).

#[path = "../src/native/test_text.rs"]
mod test_text;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use kvmesh_preprocess::{ChatRequest, EncoderKind, EncoderPreference, ModelPreprocessor};
use proptest::prelude::*;
use serde_json::{Value, json};
use test_text::mixed_text;

fn tokenizer_dir() -> PathBuf {
    match std::env::var_os("KVMESH_QWEN3_TOKENIZER") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3"),
    }
}

fn load(dir: &Path, encoder: EncoderPreference) -> ModelPreprocessor {
    assert!(
        dir.join("tokenizer.json").is_file(),
        "no tokenizer in {}: run scripts/fetch-tokenizer.sh (or set KVMESH_QWEN3_TOKENIZER)",
        dir.display()
    );
    ModelPreprocessor::from_dir_with_encoder(dir, encoder)
        .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// The Qwen3 tokenizer with the native encoder and with `tokenizers`.
fn qwen3() -> &'static (ModelPreprocessor, ModelPreprocessor) {
    static MODELS: OnceLock<(ModelPreprocessor, ModelPreprocessor)> = OnceLock::new();
    MODELS.get_or_init(|| {
        let dir = tokenizer_dir();
        let native = load(&dir, EncoderPreference::Auto);
        let reference = load(&dir, EncoderPreference::HuggingFace);
        assert_eq!(native.encoder(), EncoderKind::Native);
        assert_eq!(reference.encoder(), EncoderKind::HuggingFace);
        (native, reference)
    })
}

/// A model directory removed on drop.
struct TempModel(PathBuf);

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The Qwen3 tokenizer reshaped like Llama-3's: numbers in runs of up to three,
/// `ignore_merges`, no normalizer, and a post-processor that prepends `<|endoftext|>`.
fn llama3_like() -> &'static (ModelPreprocessor, ModelPreprocessor) {
    static MODELS: OnceLock<(ModelPreprocessor, ModelPreprocessor)> = OnceLock::new();
    MODELS.get_or_init(|| {
        let source = tokenizer_dir().join("tokenizer.json");
        let text = fs::read_to_string(&source).unwrap();
        let mut tokenizer: Value = serde_json::from_str(&text).unwrap();
        let split = &mut tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"];
        let pattern = split.as_str().unwrap().replace(r"|\p{N}|", r"|\p{N}{1,3}|");
        *split = Value::from(pattern);
        tokenizer["normalizer"] = Value::Null;
        tokenizer["model"]["ignore_merges"] = Value::from(true);
        tokenizer["post_processor"] = json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643],
                                                 "tokens": ["<|endoftext|>"]}}});
        let dir = TempModel(std::env::temp_dir().join(format!(
            "kvmesh-preprocess-llama3-like-{}",
            std::process::id()
        )));
        fs::create_dir_all(&dir.0).unwrap();
        fs::write(dir.0.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        fs::write(dir.0.join("tokenizer_config.json"), "{}").unwrap();
        let native = load(&dir.0, EncoderPreference::Auto);
        let reference = load(&dir.0, EncoderPreference::HuggingFace);
        assert_eq!(native.encoder(), EncoderKind::Native);
        (native, reference)
    })
}

/// Asserts both encoders give the same ids for `text`, as a chat and as a completions prompt.
fn assert_same(models: &(ModelPreprocessor, ModelPreprocessor), text: &str) {
    let (native, reference) = models;
    assert_eq!(
        native.encode_chat(text).unwrap(),
        reference.encode_chat(text).unwrap(),
        "encode_chat {text:?}"
    );
    assert_eq!(
        native.encode_prompt(text).unwrap(),
        reference.encode_prompt(text).unwrap(),
        "encode_prompt {text:?}"
    );
}

#[test]
fn whitespace_corner_cases() {
    for text in [
        "",
        " ",
        "a  b",
        "a \n b",
        "a   ",
        "trailing spaces   ",
        " \n\n ",
        "\n",
        "\r\n",
        "\t",
        "x\t\ty",
        "a\r\n\r\nb",
        "  leading",
        "\u{a0}a",
        "a\u{3000}\u{3000}b",
        "end\n",
        "a \t\n",
        "   \n   \n",
        "word \u{85}next",
        "a\u{2028}b",
    ] {
        assert_same(qwen3(), text);
        assert_same(llama3_like(), text);
    }
}

#[test]
fn long_pieces_take_the_heap_merge_path() {
    let texts = [
        "a".repeat(1000),
        "ab".repeat(300),
        "=".repeat(200),
        " ".repeat(500),
        "\n".repeat(100),
        "x".repeat(49),
        "Pneumonoultramicroscopicsilicovolcanoconiosis".repeat(5),
        "中文".repeat(100),
        "😀".repeat(60),
        "1".repeat(100),
    ];
    for text in &texts {
        assert_same(qwen3(), text);
        assert_same(llama3_like(), text);
    }
}

#[test]
fn qwen3_fixture_renders_match() {
    #[derive(serde::Deserialize)]
    struct Fixtures {
        chat_cases: Vec<Case>,
    }
    #[derive(serde::Deserialize)]
    struct Case {
        rendered: String,
    }
    let fixtures: Fixtures =
        serde_json::from_str(include_str!("fixtures/qwen3_chat_cases.json")).unwrap();
    for case in &fixtures.chat_cases {
        assert_same(qwen3(), &case.rendered);
        assert_same(llama3_like(), &case.rendered);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn random_text_gets_the_same_ids(text in mixed_text()) {
        assert_same(qwen3(), &text);
    }

    #[test]
    fn random_text_gets_the_same_ids_llama3_like(text in mixed_text()) {
        assert_same(llama3_like(), &text);
    }

    #[test]
    fn arbitrary_strings_get_the_same_ids(text in any::<String>()) {
        assert_same(qwen3(), &text);
    }

    #[test]
    fn chat_template_renders_get_the_same_ids(
        turns in proptest::collection::vec(mixed_text(), 1..6),
        thinking in any::<bool>(),
    ) {
        let messages: Vec<Value> = turns
            .iter()
            .enumerate()
            .map(|(i, text)| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                json!({"role": role, "content": text})
            })
            .collect();
        let body = json!({"messages": messages,
                          "chat_template_kwargs": {"enable_thinking": thinking}})
            .to_string();
        let request = ChatRequest::from_slice(body.as_bytes()).unwrap();
        let (native, reference) = qwen3();
        let rendered = native.render_chat(&request).unwrap();
        prop_assert_eq!(
            native.encode_chat(&rendered).unwrap(),
            reference.encode_chat(&rendered).unwrap(),
            "{:?}", rendered
        );
    }
}

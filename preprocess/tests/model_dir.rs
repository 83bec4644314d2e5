//! Loading a model directory and rendering with a small hand-made tokenizer (no download needed).

use std::fs;
use std::path::{Path, PathBuf};

use kvmesh_preprocess::{ChatRequest, ContentFormat, ModelPreprocessor, PreprocessError};

/// A word-level tokenizer with `<s>`/`</s>` special tokens and a `<s> $A` post-processor.
const TOKENIZER: &str = r#"{
    "version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [
        {"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
    "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
    "decoder": null,
    "model": {"type": "WordLevel",
              "vocab": {"<s>": 0, "</s>": 1, "user": 2, "assistant": 3, "hi": 4, "there": 5, ":": 6, "[UNK]": 7},
              "unk_token": "[UNK]"}
}"#;

/// A temporary model directory, removed on drop.
struct ModelDir(PathBuf);

impl ModelDir {
    fn new(name: &str, config: &str, template_file: Option<&str>) -> Self {
        let dir =
            std::env::temp_dir().join(format!("kvmesh-preprocess-{}-{name}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("tokenizer.json"), TOKENIZER).unwrap();
        fs::write(dir.join("tokenizer_config.json"), config).unwrap();
        if let Some(t) = template_file {
            fs::write(dir.join("chat_template.jinja"), t).unwrap();
        }
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ModelDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}\
    {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('Unsupported role: ' + m.role) }}{% endif %}\
    {{ m.role }} : {{ m.content }} {{ eos_token }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}";

fn config_with_template() -> String {
    format!(
        r#"{{"bos_token": {{"content": "<s>"}}, "eos_token": "</s>", "chat_template": {}}}"#,
        serde_json::to_string(TEMPLATE).unwrap()
    )
}

#[test]
fn renders_with_special_tokens_and_encodes() {
    let dir = ModelDir::new("render", &config_with_template(), None);
    let model = ModelPreprocessor::from_dir(dir.path()).unwrap();
    let body = br#"{"messages": [{"role": "user", "content": "hi there"}]}"#;
    let request = ChatRequest::from_slice(body).unwrap();
    let rendered = model.render_chat(&request).unwrap();
    assert_eq!(rendered, "<s>user : hi there </s> assistant :");
    assert_eq!(
        model.encode_chat(&rendered).unwrap(),
        [0, 2, 6, 4, 5, 1, 3, 6]
    );
    // Completions go through the post-processor, which prepends <s>.
    assert_eq!(model.encode_prompt("hi").unwrap(), [0, 4]);
}

#[test]
fn raise_exception_becomes_a_client_error_with_the_message() {
    let dir = ModelDir::new("raise", &config_with_template(), None);
    let model = ModelPreprocessor::from_dir(dir.path()).unwrap();
    let request =
        ChatRequest::from_slice(br#"{"messages": [{"role": "critic", "content": "x"}]}"#).unwrap();
    let err = model.render_chat(&request).unwrap_err();
    assert!(matches!(err, PreprocessError::Template(_)), "{err:?}");
    assert!(err.is_client_error());
    assert_eq!(err.to_string(), "Unsupported role: critic");
}

#[test]
fn chat_template_jinja_file_wins_over_the_config() {
    let dir = ModelDir::new(
        "jinja-file",
        &config_with_template(),
        Some(
            "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}",
        ),
    );
    let model = ModelPreprocessor::from_dir(dir.path()).unwrap();
    assert_eq!(model.content_format(), ContentFormat::OpenAi);
    let request =
        ChatRequest::from_slice(br#"{"messages": [{"role": "user", "content": "hi"}]}"#).unwrap();
    assert_eq!(model.render_chat(&request).unwrap(), "[hi]");
    let model = model.with_content_format(ContentFormat::String);
    assert_eq!(model.render_chat(&request).unwrap(), "[][]");
}

#[test]
fn model_without_template_still_tokenizes() {
    let dir = ModelDir::new("no-template", r#"{"add_bos_token": false}"#, None);
    let model = ModelPreprocessor::from_dir(dir.path()).unwrap();
    assert!(!model.has_chat_template());
    // An explicit add_bos_token=false replaces the post-processor, as transformers does.
    assert_eq!(model.encode_prompt("hi").unwrap(), [4]);
    let request =
        ChatRequest::from_slice(br#"{"messages": [{"role": "user", "content": "hi"}]}"#).unwrap();
    assert!(matches!(
        model.render_chat(&request),
        Err(PreprocessError::NoChatTemplate)
    ));
}

#[test]
fn missing_files_are_reported_with_their_path() {
    let err = ModelPreprocessor::from_dir("/nonexistent/kvmesh-model").unwrap_err();
    assert!(matches!(err, PreprocessError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[test]
fn template_syntax_errors_fail_loading() {
    let dir = ModelDir::new("bad-template", r#"{"chat_template": "{% for %}"}"#, None);
    let err = ModelPreprocessor::from_dir(dir.path()).unwrap_err();
    assert!(
        matches!(err, PreprocessError::TemplateCompile(_)),
        "{err:?}"
    );
}

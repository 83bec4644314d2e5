//! Ground truth: prompts and token ids must equal what vLLM computes with Hugging Face
//! `transformers` for the Qwen3 tokenizer (fixtures from `tests/fixtures/gen_qwen3_fixtures.py`).
//!
//! Needs the tokenizer fetched by `scripts/fetch-tokenizer.sh` (or `KVMESH_QWEN3_TOKENIZER`
//! pointing at a directory with the same files).

use std::path::PathBuf;
use std::sync::OnceLock;

use kvmesh_preprocess::{ChatRequest, ContentFormat, ModelPreprocessor};
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixtures {
    chat_cases: Vec<ChatCase>,
    prompt_cases: Vec<PromptCase>,
}

#[derive(Deserialize)]
struct ChatCase {
    name: String,
    body: String,
    rendered: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct PromptCase {
    text: String,
    ids: Vec<u32>,
}

fn tokenizer_dir() -> PathBuf {
    match std::env::var_os("KVMESH_QWEN3_TOKENIZER") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3"),
    }
}

fn load() -> ModelPreprocessor {
    let dir = tokenizer_dir();
    assert!(
        dir.join("tokenizer.json").is_file(),
        "the Qwen3 tokenizer is missing from {}: run scripts/fetch-tokenizer.sh \
             (or set KVMESH_QWEN3_TOKENIZER to a directory holding tokenizer.json and tokenizer_config.json)",
        dir.display()
    );
    ModelPreprocessor::from_dir(&dir).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

fn model() -> &'static ModelPreprocessor {
    static MODEL: OnceLock<ModelPreprocessor> = OnceLock::new();
    MODEL.get_or_init(load)
}

fn fixtures() -> Fixtures {
    let text = include_str!("fixtures/qwen3_chat_cases.json");
    serde_json::from_str(text).expect("fixture JSON parses")
}

/// Where two sequences first differ, for readable failures.
fn first_difference<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn chat_cases_render_and_tokenize_like_vllm() {
    let model = model();
    let fixtures = fixtures();
    assert!(fixtures.chat_cases.len() >= 10);
    let mut failures = Vec::new();
    for case in &fixtures.chat_cases {
        let request = ChatRequest::from_slice(case.body.as_bytes())
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let rendered = match model.render_chat(&request) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{}: render failed: {e}", case.name));
                continue;
            }
        };
        if rendered != case.rendered {
            let at = first_difference(rendered.as_bytes(), case.rendered.as_bytes());
            let from = at.saturating_sub(40);
            failures.push(format!(
                "{}: rendered text differs at byte {at}:\n  got:  {:?}\n  want: {:?}",
                case.name,
                String::from_utf8_lossy(&rendered.as_bytes()[from..(at + 40).min(rendered.len())]),
                String::from_utf8_lossy(
                    &case.rendered.as_bytes()[from..(at + 40).min(case.rendered.len())]
                ),
            ));
            continue;
        }
        let ids = model.encode_chat(&rendered).expect("encode");
        if ids != case.ids {
            let at = first_difference(&ids, &case.ids);
            failures.push(format!(
                "{}: ids differ at position {at} (got {} ids, want {})",
                case.name,
                ids.len(),
                case.ids.len()
            ));
        }
        assert_eq!(model.chat_token_ids(&request).expect("chat_token_ids"), ids);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn segment_cache_gives_the_same_ids() {
    let cached = load().with_segment_cache(100_000);
    assert!(cached.segment_cache_enabled());
    let fixtures = fixtures();
    // Twice: the first pass fills the cache, the second reads from it.
    for pass in 0..2 {
        for case in &fixtures.chat_cases {
            assert_eq!(
                cached.encode_chat(&case.rendered).unwrap(),
                case.ids,
                "{} (pass {pass})",
                case.name
            );
        }
    }
    // A long text with special tokens at its edges and an empty piece between two of them.
    let text = format!("<|im_start|><|im_end|>{0}<think>{0}", "word ".repeat(200));
    assert_eq!(
        cached.encode_chat(&text).unwrap(),
        model().encode_chat(&text).unwrap()
    );
    assert_eq!(
        cached.encode_chat(&text).unwrap(),
        model().encode_chat(&text).unwrap()
    );
}

#[test]
fn prompt_cases_tokenize_like_transformers() {
    let model = model();
    for case in fixtures().prompt_cases {
        assert_eq!(
            model.encode_prompt(&case.text).unwrap(),
            case.ids,
            "{:?}",
            case.text
        );
    }
}

#[test]
fn hello_world_has_the_known_qwen_ids() {
    assert_eq!(model().encode_prompt("Hello world").unwrap(), [9707, 1879]);
    assert_eq!(model().encode_chat("Hello world").unwrap(), [9707, 1879]);
}

#[test]
fn qwen3_template_takes_string_content() {
    assert!(model().has_chat_template());
    assert_eq!(model().content_format(), ContentFormat::String);
}

#[test]
fn special_tokens_in_text_are_matched() {
    let ids = model()
        .encode_chat("<|im_start|>user\nhi<|im_end|>")
        .unwrap();
    assert_eq!(ids.first(), Some(&151644), "{ids:?}");
    assert_eq!(ids.last(), Some(&151645), "{ids:?}");
}

#[test]
fn image_content_is_reported_as_unsupported() {
    let body = br#"{"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}"#;
    let request = ChatRequest::from_slice(body).unwrap();
    let err = model().render_chat(&request).unwrap_err();
    assert!(!err.is_client_error(), "{err}");
    assert!(err.to_string().contains("image_url"), "{err}");
}

//! Reading the engine's OpenAI completion answers: a whole completion, a streamed chunk,
//! or an error body.

use serde::Deserialize;

use crate::frontend::grpc::outputs::{Piece, Usage};

/// Longest engine error text quoted in a gRPC status message.
const MAX_ERROR_CHARS: usize = 512;

#[derive(Deserialize)]
struct Completion {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<UsageJson>,
    #[serde(default)]
    error: Option<ErrorJson>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct UsageJson {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ErrorJson {
    Object {
        #[serde(default)]
        message: Option<String>,
    },
    Text(String),
}

#[derive(Deserialize)]
struct FlatError {
    message: String,
}

/// A completion or a streamed chunk (its first choice); `Err` holds the engine's message
/// when it is an error object, or why it could not be read.
pub(crate) fn parse_completion(json: &[u8]) -> Result<Piece, String> {
    let completion: Completion = serde_json::from_slice(json)
        .map_err(|error| format!("the engine's answer is not a completion: {error}"))?;
    if let Some(error) = completion.error {
        return Err(format!(
            "the engine reported an error: {}",
            error_text(error)
        ));
    }
    let choice = completion.choices.into_iter().next();
    let (text, finish_reason) = choice.map_or((None, None), |c| (c.text, c.finish_reason));
    Ok(Piece {
        text: text.unwrap_or_default(),
        finish_reason,
        usage: completion.usage.map(|u| Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
        }),
    })
}

/// The message of an engine error body: OpenAI's `{"error": {"message"}}`, a flat
/// `{"message"}`, or the text itself (shortened).
pub(crate) fn error_message(body: &[u8]) -> String {
    if let Ok(Completion {
        error: Some(error), ..
    }) = serde_json::from_slice::<Completion>(body)
    {
        return error_text(error);
    }
    if let Ok(flat) = serde_json::from_slice::<FlatError>(body) {
        return shorten(&flat.message);
    }
    shorten(String::from_utf8_lossy(body).trim())
}

fn error_text(error: ErrorJson) -> String {
    match error {
        ErrorJson::Object { message } => shorten(message.as_deref().unwrap_or("(no message)")),
        ErrorJson::Text(text) => shorten(&text),
    }
}

fn shorten(text: &str) -> String {
    match text.char_indices().nth(MAX_ERROR_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_completions_and_chunks() {
        let whole = br#"{"id":"x","object":"text_completion","choices":[{"index":0,"text":"abc","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}"#;
        let piece = parse_completion(whole).unwrap();
        assert_eq!(piece.text, "abc");
        assert_eq!(piece.finish_reason.as_deref(), Some("length"));
        assert_eq!(
            piece.usage,
            Some(Usage {
                prompt_tokens: 4,
                completion_tokens: 3
            })
        );
        let chunk = br#"{"choices":[{"index":0,"text":" d","finish_reason":null}]}"#;
        assert_eq!(
            parse_completion(chunk).unwrap(),
            Piece {
                text: " d".into(),
                ..Default::default()
            }
        );
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}"#;
        assert!(parse_completion(usage).unwrap().is_usage_only());
    }

    #[test]
    fn errors_carry_the_engine_message() {
        let error = parse_completion(br#"{"error":{"message":"boom","type":"x"}}"#).unwrap_err();
        assert_eq!(error, "the engine reported an error: boom");
        assert!(
            parse_completion(b"not json")
                .unwrap_err()
                .contains("not a completion")
        );
        assert_eq!(
            error_message(br#"{"error":{"message":"max_tokens too large"}}"#),
            "max_tokens too large"
        );
        assert_eq!(
            error_message(br#"{"message":"Model not found","type":"Not Found","code":404}"#),
            "Model not found"
        );
        assert_eq!(error_message(b" plain text \n"), "plain text");
        let long = "x".repeat(MAX_ERROR_CHARS + 10);
        assert_eq!(
            error_message(long.as_bytes()).chars().count(),
            MAX_ERROR_CHARS + 1
        );
    }
}

//! An engine's OpenAI completion JSON as the gRPC listener reads it
//! (`kvmesh_wire::engine_json`): a whole completion or a streamed chunk (`parse_completion`,
//! its first choice's text and finish reason, its usage) and an error body (`error_message`).
//!
//! Whatever the bytes: nothing panics; a completion that is read holds what a generic JSON
//! reading of the same bytes finds there (`choices[0].text` and `.finish_reason`, `usage`'s
//! token counts, no `error`), where that reading accepts them (serde_json skips the fields
//! it ignores unchecked: invalid UTF-8 or escapes there fail only the generic reading); an
//! error the engine reported is quoted as `error_message` quotes it; and a quoted message is
//! at most 512 characters and an ellipsis.

#![no_main]

use kvmesh_wire::engine_json::{MAX_ERROR_CHARS, Usage, error_message, parse_completion};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const REPORTED: &str = "the engine reported an error: ";

fuzz_target!(|data: &[u8]| {
    let message = error_message(data);
    assert!(
        message.chars().count() <= MAX_ERROR_CHARS + 1,
        "{message:?}"
    );
    match parse_completion(data) {
        Ok(piece) => {
            let Ok(value) = serde_json::from_slice::<Value>(data) else {
                return;
            };
            assert!(value.get("error").is_none_or(Value::is_null), "{value}");
            let choice = &value["choices"][0];
            assert_eq!(piece.text, choice["text"].as_str().unwrap_or_default());
            assert_eq!(
                piece.finish_reason.as_deref(),
                choice["finish_reason"].as_str()
            );
            let usage = value.get("usage").filter(|usage| !usage.is_null());
            let tokens = |usage: &Value, name: &str| usage[name].as_u64().unwrap_or_default();
            assert_eq!(
                piece.usage,
                usage.map(|usage| Usage {
                    prompt_tokens: tokens(usage, "prompt_tokens"),
                    completion_tokens: tokens(usage, "completion_tokens"),
                })
            );
        }
        Err(error) => {
            if let Some(quoted) = error.strip_prefix(REPORTED) {
                assert_eq!(quoted, message);
            }
        }
    }
});

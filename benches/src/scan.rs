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

/// The `usage.completion_tokens` count in a response or chunk, if present.
pub fn completion_tokens(json: &[u8]) -> Option<u64> {
    let value = values_after(json, br#""completion_tokens":"#).next()?;
    let digits = value.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    value[..digits].iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
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
    fn recognises_error_objects() {
        assert!(is_error_object(br#"{"error":{"message":"boom"}}"#));
        assert!(is_error_object(br#" { "error": "boom"}"#));
        assert!(!is_error_object(br#"{"id":"x","choices":[]}"#));
        assert!(!is_error_object(b""));
    }
}

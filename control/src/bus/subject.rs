//! NATS subject rules: validation and wildcard matching.

use crate::error::ControlError;

/// Checks a subject: non-empty `.`-separated non-empty tokens without whitespace; `*` and `>`
/// only as whole tokens, `>` only last, and only when `wildcards` are allowed (subscriptions).
pub fn validate_subject(subject: &str, wildcards: bool) -> Result<(), ControlError> {
    let bad = |why: &str| {
        Err(ControlError::InvalidName(format!(
            "subject {subject:?}: {why}"
        )))
    };
    if subject.is_empty() {
        return bad("empty");
    }
    if subject.bytes().any(|b| b <= b' ' || b == 0x7F) {
        return bad("contains whitespace or control characters");
    }
    let mut tokens = subject.split('.').peekable();
    while let Some(token) = tokens.next() {
        if token.is_empty() {
            return bad("empty token");
        }
        let wild = token == "*" || token == ">";
        if wild && !wildcards {
            return bad("wildcards are not allowed here");
        }
        if token == ">" && tokens.peek().is_some() {
            return bad("'>' must be the last token");
        }
        if !wild && token.contains(['*', '>']) {
            return bad("'*' and '>' must be whole tokens");
        }
    }
    Ok(())
}

/// Whether a published `subject` matches a subscription `pattern` (with `*` and `>`).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for p in pattern.split('.') {
        if p == ">" {
            return subject_tokens.next().is_some();
        }
        match subject_tokens.next() {
            Some(s) if p == "*" || p == s => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_like_nats() {
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.b.c"));
        assert!(subject_matches("a.*", "a.b"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches("*.kv.*", "ns.kv.m"));
        assert!(!subject_matches("a.b.c", "a.b"));
    }

    #[test]
    fn subjects_are_validated() {
        assert!(validate_subject("kvmesh.kv.Qwen%2FQwen3-0%2E6B", false).is_ok());
        assert!(validate_subject("a.*.>", true).is_ok());
        for bad in ["", "a..b", "a b", "a.*", "a.>.b", "a.b*", ".a", "a."] {
            assert!(validate_subject(bad, false).is_err(), "{bad:?}");
        }
        assert!(validate_subject("a.>.b", true).is_err());
    }
}

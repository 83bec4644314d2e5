//! A lexical scan of a Jinja template's `{% ... %}` statements.
//!
//! Used to rewrite Hugging Face's `{% generation %}` extension tag into plain Jinja and to detect
//! the template's content format ([`crate::ContentFormat`]) without a full Jinja parser.

use std::ops::Range;

/// One `{% ... %}` statement found in a template.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct BlockTag<'a> {
    /// The statement text between the delimiters, without whitespace-control markers, trimmed.
    pub(crate) body: &'a str,
    /// Byte range of `body`'s untrimmed slot (between the markers) in the template source.
    pub(crate) inner: Range<usize>,
}

/// Finds the end of a quoted string starting at `start` (the quote); returns the index after it.
fn skip_string(bytes: &[u8], start: usize) -> usize {
    let quote = bytes[start];
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b if b == quote => return i + 1,
            _ => i += 1,
        }
    }
    bytes.len()
}

/// Finds `close` (a two-byte delimiter) from `from`, skipping quoted strings.
fn find_close(bytes: &[u8], from: usize, close: &[u8; 2]) -> Option<usize> {
    let mut i = from;
    while i + 1 < bytes.len() {
        match bytes[i] {
            b'\'' | b'"' => i = skip_string(bytes, i),
            _ if bytes[i..].starts_with(close) => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// Every `{% ... %}` statement of `source`, in order; comments and `{{ ... }}` are skipped.
pub(crate) fn block_tags(source: &str) -> Vec<BlockTag<'_>> {
    let bytes = source.as_bytes();
    let mut tags = Vec::new();
    let mut i = 0;
    while i + 1 < bytes.len() {
        if bytes[i] != b'{' {
            i += 1;
            continue;
        }
        let close: &[u8; 2] = match bytes[i + 1] {
            b'%' => b"%}",
            b'{' => b"}}",
            b'#' => b"#}",
            _ => {
                i += 1;
                continue;
            }
        };
        let open_end = i + 2;
        let Some(end) = find_close(bytes, open_end, close) else {
            break;
        };
        if close == b"%}" {
            let mut start = open_end;
            if matches!(bytes.get(start), Some(b'-' | b'+')) {
                start += 1;
            }
            let mut stop = end;
            if stop > start && matches!(bytes[stop - 1], b'-' | b'+') {
                stop -= 1;
            }
            tags.push(BlockTag {
                body: source[start..stop].trim(),
                inner: start..stop,
            });
        }
        i = end + 2;
    }
    tags
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (Hugging Face's assistant-mask extension,
/// which renders its body unchanged) as `{% if true %}` / `{% endif %}`. The delimiters and
/// whitespace-control markers are kept, so trimming behaves exactly as before.
pub(crate) fn rewrite_generation_tags(source: &str) -> Option<String> {
    let tags: Vec<_> = block_tags(source)
        .into_iter()
        .filter(|t| t.body == "generation" || t.body == "endgeneration")
        .collect();
    if tags.is_empty() {
        return None;
    }
    let mut out = String::with_capacity(source.len());
    let mut last = 0;
    for tag in tags {
        out.push_str(&source[last..tag.inner.start]);
        out.push_str(if tag.body == "generation" {
            " if true "
        } else {
            " endif "
        });
        last = tag.inner.end;
    }
    out.push_str(&source[last..]);
    Some(out)
}

/// A token of a statement body: what the content-format detection needs to tell apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Token<'a> {
    /// A name or keyword.
    Ident(&'a str),
    /// A string literal's text, without quotes (escapes are not decoded).
    Str(&'a str),
    /// A number literal.
    Number,
    /// Any other single character (`.`, `[`, `|`, `=`, ...), or `==`-style pairs as two tokens.
    Punct(char),
}

/// Splits a statement body into [`Token`]s.
pub(crate) fn tokenize(body: &str) -> Vec<Token<'_>> {
    let bytes = body.as_bytes();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b.is_ascii_whitespace() {
            i += 1;
        } else if b == b'_' || b.is_ascii_alphabetic() {
            let start = i;
            while i < bytes.len() && (bytes[i] == b'_' || bytes[i].is_ascii_alphanumeric()) {
                i += 1;
            }
            tokens.push(Token::Ident(&body[start..i]));
        } else if b.is_ascii_digit() {
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            tokens.push(Token::Number);
        } else if b == b'\'' || b == b'"' {
            let end = skip_string(bytes, i);
            let text_end = end.saturating_sub(1).max(i + 1);
            tokens.push(Token::Str(&body[i + 1..text_end]));
            i = end;
        } else {
            let c = body[i..].chars().next().unwrap_or('?');
            tokens.push(Token::Punct(c));
            i += c.len_utf8();
        }
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_block_tags_and_skips_the_rest() {
        let src = "{# {% for x in y %} #}{{ '{%' }}{%- for m in messages -%}x{% endfor %}{%+ set a = '%}' +%}";
        let bodies: Vec<_> = block_tags(src).into_iter().map(|t| t.body).collect();
        assert_eq!(bodies, ["for m in messages", "endfor", "set a = '%}'"]);
    }

    #[test]
    fn generation_tags_become_if_true() {
        let src = "a{%- generation -%}b{% endgeneration %}c";
        assert_eq!(
            rewrite_generation_tags(src).unwrap(),
            "a{%- if true -%}b{% endif %}c"
        );
        assert_eq!(rewrite_generation_tags("{% if x %}{% endif %}"), None);
    }

    #[test]
    fn tokenizes_statement_bodies() {
        assert_eq!(
            tokenize("for c in message['content'][1:]|x"),
            [
                Token::Ident("for"),
                Token::Ident("c"),
                Token::Ident("in"),
                Token::Ident("message"),
                Token::Punct('['),
                Token::Str("content"),
                Token::Punct(']'),
                Token::Punct('['),
                Token::Number,
                Token::Punct(':'),
                Token::Punct(']'),
                Token::Punct('|'),
                Token::Ident("x"),
            ]
        );
    }
}

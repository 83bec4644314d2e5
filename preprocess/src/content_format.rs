//! How message content is handed to a chat template, and vLLM's detection of it.

use std::collections::HashSet;

use crate::template_scan::{Token, block_tags, tokenize};

/// The shape in which message `content` reaches the chat template (vLLM's
/// `--chat-template-content-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Content is one string; a list of parts is joined with `"\n"` (most text-only templates).
    String,
    /// Content is a list of `{"type": "text", "text": ...}` parts; a plain string becomes one part.
    OpenAi,
}

impl ContentFormat {
    /// Detects the format the way vLLM's `auto` mode does: [`ContentFormat::OpenAi`] when the
    /// template loops over a message's content (`{% for part in message['content'] %}`, where
    /// `message` is a loop variable over `messages` or a variable assigned from it), otherwise
    /// [`ContentFormat::String`].
    pub fn detect(template: &str) -> Self {
        let statements: Vec<Vec<Token<'_>>> = block_tags(template)
            .into_iter()
            .map(|tag| tokenize(tag.body))
            .collect();

        let messages_vars = related_message_vars(&statements);
        let mut item_vars: HashSet<&str> = HashSet::new();
        for stmt in &statements {
            if let Some((targets, access)) = for_loop(stmt)
                && access.key.is_none()
                && messages_vars.contains(access.name)
            {
                match targets {
                    [Token::Ident(t)] => {
                        item_vars.insert(t);
                    }
                    // vLLM's detection asserts a single loop target and falls back to "string".
                    _ => return Self::String,
                }
            }
        }
        for stmt in &statements {
            if let Some((targets, access)) = for_loop(stmt)
                && access.key == Some("content")
                && item_vars.contains(access.name)
            {
                return match targets {
                    [Token::Ident(_)] => Self::OpenAi,
                    _ => Self::String,
                };
            }
        }
        Self::String
    }
}

/// `messages` and every variable assigned from it (`{% set loop_messages = messages[1:] %}`), transitively.
fn related_message_vars<'a>(statements: &[Vec<Token<'a>>]) -> HashSet<&'a str> {
    let mut related: HashSet<&str> = HashSet::from(["messages"]);
    loop {
        let mut grew = false;
        for stmt in statements {
            if let [
                Token::Ident("set"),
                Token::Ident(lhs),
                Token::Punct('='),
                rhs @ ..,
            ] = stmt.as_slice()
                && let Some(access) = var_access(rhs, false)
                && access.key.is_none()
                && related.contains(access.name)
            {
                grew |= related.insert(lhs);
            }
        }
        if !grew {
            return related;
        }
    }
}

/// `for TARGETS in ITER ...`: the target tokens and the iterated access, if ITER is one.
fn for_loop<'s, 'a>(stmt: &'s [Token<'a>]) -> Option<(&'s [Token<'a>], Access<'a>)> {
    let [Token::Ident("for"), rest @ ..] = stmt else {
        return None;
    };
    let in_pos = rest.iter().position(|t| *t == Token::Ident("in"))?;
    let access = var_access(&rest[in_pos + 1..], true)?;
    Some((&rest[..in_pos], access))
}

/// A variable, or one element of it (`var.key` / `var['key']`), under any slices, filters and tests.
#[derive(Debug, PartialEq, Eq)]
struct Access<'a> {
    name: &'a str,
    key: Option<&'a str>,
}

/// A postfix step after a variable name.
enum Step<'a> {
    Key(&'a str),
    Slice,
}

/// Matches vLLM's `_is_var_or_elems_access`: `name`, `name.key` or `name['key']`, followed by any
/// slices, then optionally by a filter (`|...`) or test (`is ...`). In a `for` statement a loop
/// filter (`if ...`) or `recursive` may follow too.
fn var_access<'a>(tokens: &[Token<'a>], in_for: bool) -> Option<Access<'a>> {
    let [Token::Ident(name), rest @ ..] = tokens else {
        return None;
    };
    if matches!(
        *name,
        "not" | "true" | "false" | "none" | "True" | "False" | "None"
    ) {
        return None;
    }
    let mut steps = Vec::new();
    let mut i = 0;
    while i < rest.len() {
        match &rest[i] {
            Token::Punct('.') => match rest.get(i + 1) {
                Some(Token::Ident(key)) => {
                    steps.push(Step::Key(key));
                    i += 2;
                }
                _ => return None,
            },
            Token::Punct('[') => {
                let close = matching_bracket(rest, i)?;
                let inside = &rest[i + 1..close];
                if let [Token::Str(key)] = inside {
                    steps.push(Step::Key(key));
                } else if inside.contains(&Token::Punct(':')) {
                    steps.push(Step::Slice);
                } else {
                    return None;
                }
                i = close + 1;
            }
            _ => break,
        }
    }
    let end_ok = match rest.get(i) {
        None | Some(Token::Punct('|')) | Some(Token::Ident("is")) => true,
        Some(Token::Ident("if" | "recursive")) => in_for,
        _ => false,
    };
    if !end_ok {
        return None;
    }
    while matches!(steps.last(), Some(Step::Slice)) {
        steps.pop();
    }
    match steps.as_slice() {
        [] => Some(Access { name, key: None }),
        [Step::Key(key)] => Some(Access {
            name,
            key: Some(key),
        }),
        _ => None,
    }
}

/// The index of the `]` that closes the `[` at `open`.
fn matching_bracket(tokens: &[Token<'_>], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, t) in tokens.iter().enumerate().skip(open) {
        match t {
            Token::Punct('[') => depth += 1,
            Token::Punct(']') => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_templates() {
        for src in [
            "{% for message in messages %}{{ message.content }}{% endfor %}",
            "{% for message in messages %}{% for x in message.tool_calls %}{% endfor %}{% endfor %}",
            "{% for c in other['content'] %}{% endfor %}",
            "{% for message in messages %}{% for c in message.content.split('x') %}{% endfor %}{% endfor %}",
            "{% for message in messages %}{% for c in message['content'] + [] %}{% endfor %}{% endfor %}",
            "no statements at all",
        ] {
            assert_eq!(ContentFormat::detect(src), ContentFormat::String, "{src}");
        }
    }

    #[test]
    fn openai_templates() {
        for src in [
            "{%- for message in messages -%}{%- for content in message['content'] -%}{%- endfor -%}{% endfor %}",
            "{% for m in messages[1:] %}{% for part in m.content | selectattr('type') %}{% endfor %}{% endfor %}",
            "{% set loop_messages = messages[1:] %}{% set msgs = loop_messages %}\
             {% for m in msgs if m.role %}{% for p in m['content'][::-1] %}{% endfor %}{% endfor %}",
            "{% for m in messages|reverse %}{% for p in m.content if p.type == 'text' %}{% endfor %}{% endfor %}",
        ] {
            assert_eq!(ContentFormat::detect(src), ContentFormat::OpenAi, "{src}");
        }
    }

    #[test]
    fn tuple_loop_targets_fall_back_to_string() {
        let src = "{% for i, m in messages %}{% endfor %}{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}";
        assert_eq!(ContentFormat::detect(src), ContentFormat::String);
    }
}

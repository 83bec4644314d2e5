//! The trivial ChatML template used for `/v1/chat/completions`.

/// One chat message after its content parts were joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// Renders `<|im_start|>role\ncontent<|im_end|>\n` per message, then `<|im_start|>assistant\n`.
pub(crate) fn render(messages: &[ChatMessage]) -> String {
    let len: usize = messages
        .iter()
        .map(|m| m.role.len() + m.content.len() + 24)
        .sum();
    let mut out = String::with_capacity(len + 24);
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        out.push_str(&m.content);
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let messages = vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
        ];
        assert_eq!(
            render(&messages),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(render(&[]), "<|im_start|>assistant\n");
    }
}

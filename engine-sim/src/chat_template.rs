//! The trivial ChatML template used for `/v1/chat/completions`.

/// One chat message after its content parts were joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// How the end of a conversation is rendered (vLLM's `add_generation_prompt` and
/// `continue_final_message`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// `<|im_start|>assistant\n` after the last message: the model answers it (the default).
    GenerationPrompt,
    /// Nothing after the last message.
    Closed,
    /// The last message is left open (no `<|im_end|>`): the model continues it.
    ContinueFinal,
}

impl Ending {
    /// The ending a chat request asks for; vLLM refuses both flags together, and a
    /// continuation needs a final assistant message.
    pub(crate) fn from_request(
        add_generation_prompt: Option<bool>,
        continue_final_message: Option<bool>,
        messages: &[ChatMessage],
    ) -> Result<Self, &'static str> {
        match (
            add_generation_prompt,
            continue_final_message.unwrap_or(false),
        ) {
            (Some(true), true) => {
                Err("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
            }
            (_, true) if messages.last().is_none_or(|m| m.role != "assistant") => {
                Err("`continue_final_message` needs the final message to be from the assistant.")
            }
            (_, true) => Ok(Self::ContinueFinal),
            (Some(false), false) => Ok(Self::Closed),
            _ => Ok(Self::GenerationPrompt),
        }
    }
}

/// Renders `<|im_start|>role\ncontent<|im_end|>\n` per message, ending as `ending` says (by
/// default with `<|im_start|>assistant\n`).
pub(crate) fn render(messages: &[ChatMessage], ending: Ending) -> String {
    let len: usize = messages
        .iter()
        .map(|m| m.role.len() + m.content.len() + 24)
        .sum();
    let mut out = String::with_capacity(len + 24);
    for (i, m) in messages.iter().enumerate() {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        out.push_str(&m.content);
        if ending == Ending::ContinueFinal && i + 1 == messages.len() {
            return out;
        }
        out.push_str("<|im_end|>\n");
    }
    if ending == Ending::GenerationPrompt {
        out.push_str("<|im_start|>assistant\n");
    }
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
            render(&messages, Ending::GenerationPrompt),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            render(&[], Ending::GenerationPrompt),
            "<|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_final_assistant_message_can_be_continued() {
        let messages = vec![
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: "Hello, how".into(),
            },
        ];
        let ending = Ending::from_request(Some(false), Some(true), &messages).unwrap();
        assert_eq!(
            render(&messages, ending),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello, how"
        );
        let closed = Ending::from_request(Some(false), None, &messages).unwrap();
        assert!(render(&messages, closed).ends_with("how<|im_end|>\n"));
        assert!(Ending::from_request(Some(true), Some(true), &messages).is_err());
        assert!(Ending::from_request(None, Some(true), &messages[..1]).is_err());
        assert_eq!(
            Ending::from_request(None, None, &messages),
            Ok(Ending::GenerationPrompt)
        );
    }
}

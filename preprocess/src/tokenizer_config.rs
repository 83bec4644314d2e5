//! `tokenizer_config.json`: the chat template, the named special tokens and the BOS/EOS flags.

use std::path::Path;

use serde::Deserialize;

use crate::error::{PreprocessError, Result};

/// The named special tokens Hugging Face passes to every chat template (`special_tokens_map`).
pub(crate) const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// What kvmesh reads from a model's `tokenizer_config.json`.
#[derive(Debug, Default)]
pub(crate) struct TokenizerConfig {
    /// The template used when a request has no tools (or the model has no tool template).
    pub(crate) chat_template: Option<String>,
    /// The template named `tool_use`, used for requests with tools when present.
    pub(crate) tool_use_template: Option<String>,
    /// `(name, content)` of each named special token that is set, in [`SPECIAL_TOKEN_NAMES`] order.
    pub(crate) special_tokens: Vec<(&'static str, String)>,
    /// `add_bos_token`, when the config states it.
    pub(crate) add_bos_token: Option<bool>,
    /// `add_eos_token`, when the config states it.
    pub(crate) add_eos_token: Option<bool>,
}

/// A special token: a plain string or an `AddedToken` object with a `content` field.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenSpec {
    Plain(String),
    Added { content: String },
}

/// A chat template: one string, or a list of named templates.
#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateSpec {
    Single(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    chat_template: Option<TemplateSpec>,
    #[serde(default)]
    add_bos_token: Option<bool>,
    #[serde(default)]
    add_eos_token: Option<bool>,
    #[serde(default)]
    bos_token: Option<TokenSpec>,
    #[serde(default)]
    eos_token: Option<TokenSpec>,
    #[serde(default)]
    unk_token: Option<TokenSpec>,
    #[serde(default)]
    sep_token: Option<TokenSpec>,
    #[serde(default)]
    pad_token: Option<TokenSpec>,
    #[serde(default)]
    cls_token: Option<TokenSpec>,
    #[serde(default)]
    mask_token: Option<TokenSpec>,
}

impl TokenSpec {
    fn into_content(self) -> String {
        match self {
            Self::Plain(s) | Self::Added { content: s } => s,
        }
    }
}

impl TokenizerConfig {
    /// Parses the text of a `tokenizer_config.json`; `path` only names it in errors.
    pub(crate) fn parse(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| PreprocessError::Config {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let (chat_template, tool_use_template) = match raw.chat_template {
            None => (None, None),
            Some(TemplateSpec::Single(t)) => (Some(t), None),
            Some(TemplateSpec::Named(list)) => {
                let mut default = None;
                let mut tool_use = None;
                for named in list {
                    match named.name.as_str() {
                        "default" => default = Some(named.template),
                        "tool_use" => tool_use = Some(named.template),
                        _ => {}
                    }
                }
                if default.is_none() && tool_use.is_none() {
                    return Err(PreprocessError::Config {
                        path: path.to_owned(),
                        message:
                            "chat_template list has neither a \"default\" nor a \"tool_use\" entry"
                                .into(),
                    });
                }
                (default, tool_use)
            }
        };
        let tokens = [
            raw.bos_token,
            raw.eos_token,
            raw.unk_token,
            raw.sep_token,
            raw.pad_token,
            raw.cls_token,
            raw.mask_token,
        ];
        let special_tokens = SPECIAL_TOKEN_NAMES
            .into_iter()
            .zip(tokens)
            .filter_map(|(name, spec)| spec.map(|s| (name, s.into_content())))
            .collect();
        Ok(Self {
            chat_template,
            tool_use_template,
            special_tokens,
            add_bos_token: raw.add_bos_token,
            add_eos_token: raw.add_eos_token,
        })
    }

    /// The content of the named special token (`"bos_token"`, `"eos_token"`, ...), if set.
    pub(crate) fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, content)| content.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<TokenizerConfig> {
        TokenizerConfig::parse(text, Path::new("tokenizer_config.json"))
    }

    #[test]
    fn string_template_and_token_forms() {
        let cfg = parse(
            r#"{"chat_template": "{{ bos_token }}", "bos_token": {"content": "<s>", "lstrip": false},
                "eos_token": "</s>", "pad_token": null, "add_bos_token": true}"#,
        )
        .unwrap();
        assert_eq!(cfg.chat_template.as_deref(), Some("{{ bos_token }}"));
        assert_eq!(cfg.special_token("bos_token"), Some("<s>"));
        assert_eq!(cfg.special_token("eos_token"), Some("</s>"));
        assert_eq!(cfg.special_token("pad_token"), None);
        assert_eq!(cfg.add_bos_token, Some(true));
        assert_eq!(cfg.add_eos_token, None);
    }

    #[test]
    fn named_templates_pick_default_and_tool_use() {
        let cfg = parse(
            r#"{"chat_template": [{"name": "rag", "template": "r"}, {"name": "default", "template": "d"},
                {"name": "tool_use", "template": "t"}]}"#,
        )
        .unwrap();
        assert_eq!(cfg.chat_template.as_deref(), Some("d"));
        assert_eq!(cfg.tool_use_template.as_deref(), Some("t"));
    }

    #[test]
    fn named_templates_without_default_are_rejected() {
        let err = parse(r#"{"chat_template": [{"name": "rag", "template": "r"}]}"#).unwrap_err();
        assert!(err.to_string().contains("default"), "{err}");
    }

    #[test]
    fn missing_template_is_allowed() {
        let cfg = parse("{}").unwrap();
        assert!(cfg.chat_template.is_none());
        assert!(cfg.special_tokens.is_empty());
    }

    #[test]
    fn malformed_json_names_the_file() {
        let err = parse("{").unwrap_err();
        assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    }
}

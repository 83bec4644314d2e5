//! API keys: who may call the data listeners, which models each key may use,
//! and its rate limits. Keys are stored as SHA-256 hashes, never in clear.

use std::collections::{HashMap, HashSet};

use serde::Deserialize;

use crate::violation::{Checked, fail};
use crate::{Config, FieldPath};

/// Authentication of data-listener requests (`Authorization: Bearer <key>`).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// The accepted keys; empty (the default) turns authentication off.
    pub keys: Vec<ApiKeyConfig>,
}

impl AuthConfig {
    /// Whether requests must present a key.
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }
}

/// One API key and its limits.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// Name used in metrics and logs (the key itself never appears anywhere);
    /// letters, digits, `-`, `_` and `.`.
    pub name: String,
    /// SHA-256 of the key as 64 hex digits (`kvmesh-proxy hash-key` prints it).
    pub sha256: String,
    /// Models (names or aliases) the key may use; empty (the default): every model.
    #[serde(default)]
    pub models: Vec<String>,
    /// Sustained requests per second, with a burst of one second's worth (at
    /// least 1); `null` (the default): unlimited.
    #[serde(default)]
    pub requests_per_second: Option<f64>,
    /// Prompt plus completion tokens per minute, with a burst of one minute's
    /// worth; `null` (the default): unlimited.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Requests of this key in flight at once; `null` (the default): unlimited.
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// The key may use the engines' admin and development routes (`/reset_prefix_cache`,
    /// `/sleep`, adapter loading, …: the admin routes of `ENGINE_ROUTES`); default false.
    #[serde(default)]
    pub engine_admin: bool,
}

/// Length of a SHA-256 digest in hex digits.
const SHA256_HEX_LEN: usize = 64;

/// Checks `auth`; `path` is `auth`.
pub(crate) fn check_auth(config: &Config, path: &FieldPath) -> Checked {
    let served: HashSet<&str> = config
        .models
        .iter()
        .flat_map(|model| std::iter::once(&model.name).chain(&model.aliases))
        .map(String::as_str)
        .collect();
    let keys = path.key("keys");
    let mut names = HashMap::new();
    let mut hashes = HashMap::new();
    for (i, key) in config.auth.keys.iter().enumerate() {
        let at = keys.index(i);
        let name = &key.name;
        if name.is_empty() {
            return fail(at.key("name"), "must not be empty");
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return fail(
                at.key("name"),
                format!("invalid name {name:?}: use letters, digits, '-', '_' and '.'"),
            );
        }
        if let Some(first) = names.insert(name.as_str(), i) {
            return fail(
                at.key("name"),
                format!("duplicate key name {name:?} (also auth.keys[{first}])"),
            );
        }
        let digest = &key.sha256;
        if digest.len() != SHA256_HEX_LEN || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return fail(
                at.key("sha256"),
                "must be the key's SHA-256 as 64 hex digits (see `kvmesh-proxy hash-key`)",
            );
        }
        if let Some(first) = hashes.insert(digest.to_ascii_lowercase(), i) {
            return fail(
                at.key("sha256"),
                format!("the same key hash is already used by auth.keys[{first}]"),
            );
        }
        for (j, model) in key.models.iter().enumerate() {
            if !served.contains(model.as_str()) {
                return fail(
                    at.key("models").index(j),
                    format!("{model:?} is not a configured model name or alias"),
                );
            }
        }
        if let Some(rate) = key.requests_per_second
            && !(rate.is_finite() && rate > 0.0)
        {
            return fail(
                at.key("requests_per_second"),
                format!("{rate} must be a finite number > 0"),
            );
        }
        if key.tokens_per_minute == Some(0) {
            return fail(at.key("tokens_per_minute"), "must be at least 1");
        }
        if key.max_concurrency == Some(0) {
            return fail(at.key("max_concurrency"), "must be at least 1");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{Config, ConfigError};

    const MODELS: &str = "\
models:
  - name: qwen3
    aliases: [qwen]
    backends:
      - url: http://127.0.0.1:8001
  - name: llama
    backends:
      - url: http://127.0.0.1:8002
auth:
  keys:
";

    const HASH: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    fn error(keys: &str) -> String {
        match Config::from_yaml_str(&format!("{MODELS}{keys}"), "auth.yaml") {
            Ok(_) => panic!("accepted {keys}"),
            Err(ConfigError::Invalid(invalid)) => invalid.to_string(),
            Err(other) => panic!("{other}"),
        }
    }

    #[test]
    fn keys_parse_with_their_limits() {
        let text = format!(
            "{MODELS}    - name: team-a\n      sha256: {HASH}\n      models: [qwen, llama]\n      \
             requests_per_second: 2.5\n      tokens_per_minute: 1000\n      max_concurrency: 4\n    \
             - name: open\n      sha256: {}\n",
            HASH.to_uppercase().replace('9', "8")
        );
        let config = Config::from_yaml_str(&text, "auth.yaml").unwrap();
        assert!(config.auth.enabled());
        let key = &config.auth.keys[0];
        assert_eq!(key.name, "team-a");
        assert_eq!(key.models, ["qwen", "llama"]);
        assert_eq!(key.requests_per_second, Some(2.5));
        assert_eq!(key.tokens_per_minute, Some(1000));
        assert_eq!(key.max_concurrency, Some(4));
        let open = &config.auth.keys[1];
        assert!(open.models.is_empty());
        assert_eq!(open.requests_per_second, None);
        assert!(!Config::default().auth.enabled());
    }

    #[test]
    fn bad_keys_name_the_field_and_line() {
        let bad_hash = error("    - name: a\n      sha256: abc\n");
        assert!(
            bad_hash.starts_with("auth.yaml:12:15: auth.keys[0].sha256: must be the key's SHA-256"),
            "{bad_hash}"
        );
        let unknown = error(&format!(
            "    - name: a\n      sha256: {HASH}\n      models: [gpt]\n"
        ));
        assert!(
            unknown.contains("auth.keys[0].models[0]: \"gpt\" is not a configured model"),
            "{unknown}"
        );
        let duplicate = error(&format!(
            "    - name: a\n      sha256: {HASH}\n    - name: b\n      sha256: {}\n",
            HASH.to_uppercase()
        ));
        assert!(
            duplicate.contains("auth.keys[1].sha256: the same key hash"),
            "{duplicate}"
        );
        let same_name = error(&format!(
            "    - name: a\n      sha256: {HASH}\n    - name: a\n      sha256: {}\n",
            HASH.replace('9', "7")
        ));
        assert!(
            same_name.contains("auth.keys[1].name: duplicate key name"),
            "{same_name}"
        );
        let rate = error(&format!(
            "    - name: a\n      sha256: {HASH}\n      requests_per_second: 0\n"
        ));
        assert!(rate.contains("auth.keys[0].requests_per_second"), "{rate}");
        let tokens = error(&format!(
            "    - name: a\n      sha256: {HASH}\n      tokens_per_minute: 0\n"
        ));
        assert!(
            tokens.contains("auth.keys[0].tokens_per_minute: must be at least 1"),
            "{tokens}"
        );
        let name = error(&format!("    - name: 'a b'\n      sha256: {HASH}\n"));
        assert!(name.contains("auth.keys[0].name: invalid name"), "{name}");
    }
}

//! The configured keys by digest, and the check of a request's credentials.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use http::header;
use kvmesh_config::Config;
use pingora_http::RequestHeader;

use crate::edge::auth::ApiKey;
use crate::edge::auth::hash::{KeyDigest, digest, parse_sha256_hex};
use crate::edge::edge_metrics::{AuthMetrics, EdgeMetrics};

/// Why a request's credentials were refused (401).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AuthFailure {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A key that matches none configured.
    Invalid,
}

/// The keys of one config.
#[derive(Debug)]
pub(crate) struct Authenticator {
    keys: HashMap<KeyDigest, Arc<ApiKey>>,
    metrics: AuthMetrics,
}

impl Authenticator {
    /// The keys of `config`. A key whose settings are unchanged from `previous`
    /// keeps its live state (buckets, requests in flight).
    pub(crate) fn new(config: &Config, metrics: &EdgeMetrics, previous: Option<&Self>) -> Self {
        let now = Instant::now();
        let mut keys = HashMap::with_capacity(config.auth.keys.len());
        for settings in &config.auth.keys {
            // Validation guarantees 64 hex digits.
            let Some(digest) = parse_sha256_hex(&settings.sha256) else {
                continue;
            };
            let kept = previous
                .and_then(|previous| previous.keys.get(&digest))
                .filter(|key| key.settings() == settings)
                .map(Arc::clone);
            let key = kept.unwrap_or_else(|| {
                Arc::new(ApiKey::new(
                    settings,
                    config,
                    metrics.key(&settings.name),
                    now,
                ))
            });
            keys.insert(digest, key);
        }
        Self {
            keys,
            metrics: metrics.auth(),
        }
    }

    /// Whether requests must present a key.
    pub(crate) fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The key the request presents; `Ok(None)` when authentication is off.
    pub(crate) fn authenticate(
        &self,
        request: &RequestHeader,
    ) -> Result<Option<Arc<ApiKey>>, AuthFailure> {
        let authorization = request.headers.get(header::AUTHORIZATION);
        self.authenticate_value(authorization.map(http::HeaderValue::as_bytes))
    }

    /// The key an `Authorization` value (`None`: no such header) presents; `Ok(None)` when
    /// authentication is off.
    pub(crate) fn authenticate_value(
        &self,
        authorization: Option<&[u8]>,
    ) -> Result<Option<Arc<ApiKey>>, AuthFailure> {
        if !self.enabled() {
            return Ok(None);
        }
        let result = match authorization.and_then(bearer_token) {
            None => Err(AuthFailure::Missing),
            Some(token) => self
                .keys
                .get(&digest(token))
                .map(|key| Some(Arc::clone(key)))
                .ok_or(AuthFailure::Invalid),
        };
        if let Err(failure) = result {
            self.metrics.count_failure(failure);
        }
        result
    }

    /// Counts a request refused because its key may not use the model.
    pub(crate) fn count_model_not_allowed(&self) {
        self.metrics.count_model_not_allowed();
    }

    /// What each key consumed on this replica since the last call, for the other replicas:
    /// (its [`key_tag`], requests, tokens), keys that consumed nothing left out.
    pub(crate) fn take_unshared(&self) -> Vec<(u64, u64, i64)> {
        self.keys
            .iter()
            .filter_map(|(digest, key)| {
                let (requests, tokens) = key.take_unshared();
                (requests != 0 || tokens != 0).then(|| (key_tag(digest), requests, tokens))
            })
            .collect()
    }

    /// Charges what another replica's key tagged `tag` consumed to the same key here; a tag
    /// of no key here (another config) is ignored.
    pub(crate) fn charge_shared(&self, tag: u64, requests: u64, tokens: i64, now: Instant) {
        if let Some(key) = self
            .keys
            .iter()
            .find_map(|(digest, key)| (key_tag(digest) == tag).then_some(key))
        {
            key.charge_shared(requests, tokens, now);
        }
    }
}

/// How replicas name a key to each other: the first 8 bytes of its SHA-256 (not the whole
/// digest, which the bus need not carry).
pub(crate) fn key_tag(digest: &KeyDigest) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The token of an `Authorization: Bearer <token>` value.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, token) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = token.trim_ascii();
    (!token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edge::auth::sha256_hex;
    use crate::metrics::families::Metrics;

    fn config(keys: &str) -> Config {
        let text = format!(
            "models:\n  - name: m\n    aliases: [alias]\n    backends:\n      - url: http://127.0.0.1:1\n  \
             - name: other\n    backends:\n      - url: http://127.0.0.1:2\nauth:\n  keys:\n{keys}"
        );
        Config::from_yaml_str(&text, "t.yaml").unwrap()
    }

    fn request(authorization: Option<&str>) -> RequestHeader {
        let mut request = RequestHeader::build("POST", b"/v1/chat/completions", None).unwrap();
        if let Some(value) = authorization {
            request.insert_header("authorization", value).unwrap();
        }
        request
    }

    #[test]
    fn bearer_keys_are_checked_by_digest() {
        let metrics = Metrics::new().unwrap();
        let config = config(&format!(
            "    - name: a\n      sha256: {}\n      models: [alias]\n",
            sha256_hex(b"sk-a")
        ));
        let auth = Authenticator::new(&config, &metrics.edge, None);
        assert!(auth.enabled());
        let key = auth
            .authenticate(&request(Some("Bearer sk-a")))
            .unwrap()
            .unwrap();
        assert_eq!(key.settings().name, "a");
        assert!(auth.authenticate(&request(Some("bearer   sk-a "))).is_ok());
        assert_eq!(
            auth.authenticate(&request(Some("Bearer sk-b")))
                .unwrap_err(),
            AuthFailure::Invalid
        );
        for missing in [
            None,
            Some("Basic c2stYQ=="),
            Some("Bearer "),
            Some("Bearer"),
        ] {
            assert_eq!(
                auth.authenticate(&request(missing)).unwrap_err(),
                AuthFailure::Missing,
                "{missing:?}"
            );
        }
        let now = Instant::now();
        assert!(key.admit("m", now).is_ok());
        assert_eq!(
            key.admit("other", now).unwrap_err(),
            crate::edge::auth::KeyRejection::ModelNotAllowed
        );
        let open = Authenticator::new(&Config::default(), &metrics.edge, None);
        assert!(open.authenticate(&request(None)).unwrap().is_none());
    }

    #[test]
    fn unchanged_keys_keep_their_state_across_a_reload() {
        let metrics = Metrics::new().unwrap();
        let key = |limit: u32| {
            config(&format!(
                "    - name: a\n      sha256: {}\n      max_concurrency: {limit}\n",
                sha256_hex(b"sk-a")
            ))
        };
        let first = Authenticator::new(&key(1), &metrics.edge, None);
        let held = first
            .authenticate(&request(Some("Bearer sk-a")))
            .unwrap()
            .unwrap()
            .admit("m", Instant::now())
            .unwrap();
        let same = Authenticator::new(&key(1), &metrics.edge, Some(&first));
        let again = same
            .authenticate(&request(Some("Bearer sk-a")))
            .unwrap()
            .unwrap();
        assert!(Arc::ptr_eq(held.key(), &again));
        assert!(again.admit("m", Instant::now()).is_err());
        let changed = Authenticator::new(&key(2), &metrics.edge, Some(&same));
        let fresh = changed
            .authenticate(&request(Some("Bearer sk-a")))
            .unwrap()
            .unwrap();
        assert!(!Arc::ptr_eq(held.key(), &fresh));
    }
}

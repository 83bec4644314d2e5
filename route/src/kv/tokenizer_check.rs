//! Whether the proxy tokenizes a `policy: kv` model's prompts as each of its engines does.
//!
//! The proxy renders chat templates and tokenizes prompts itself to hash their blocks; an
//! engine whose tokenizer or chat template gives other token ids caches blocks whose hashes
//! the proxy's can never match, which silently turns precise routing off for it. So once
//! per instance, when it registers, the proxy sends a few [`probes`] to its engine's
//! `POST /tokenize` (vLLM's: `{"model","prompt"}` or `{"model","messages",
//! "add_generation_prompt"}`, answering `{"tokens","count","max_model_len"}`) and compares
//! the ids with its own ([`compare`]). The outcome per instance ([`TokenizerOutcome`]) is
//! kept here ([`TokenizerChecks`]); a mismatch makes the instance scored by predictions
//! alone, as for a block-size conflict, and is reported (`/health`, a gauge,
//! `x-kvmesh-route`). The HTTP side runs in the proxy, off the request path.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};

use arc_swap::ArcSwap;
use kvmesh_config::KvTokenizerCheckConfig;
use kvmesh_kv::KeyedState;
use kvmesh_preprocess::{ChatRequest, ModelPreprocessor};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The plain-text probe: words, digits, punctuation, runs of spaces and newlines, accents,
/// CJK and an emoji, where tokenizers (normalizers, pre-tokenizers, byte fallback) differ.
const PROBE_TEXT: &str = "The quick brown fox jumps over the lazy dog, 1234567890 times!\n\n\
    \tIndented  code: fn main() { println!(\"naïve café\"); }  // 東京 → Zürich 🙂";

/// The system message of the chat probes.
const PROBE_SYSTEM: &str = "You are a careful assistant. Answer in one sentence.";

/// One probe: the body to `POST /tokenize` and the token ids the proxy itself gets for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// Its name in logs, `/health` and `x-kvmesh-route` (`text`, `chat`, `chat_multi_turn`).
    pub name: &'static str,
    /// The `/tokenize` request body (JSON).
    pub body: String,
    /// The proxy's token ids of it.
    pub ids: Vec<u32>,
}

/// The probes for a model served as `model` and tokenized by `tokenizer`: a completions
/// text prompt (`add_special_tokens` true, as both vLLM and the proxy encode completions),
/// and, when the model has a chat template, two chats rendered with the generation prompt
/// (`add_special_tokens` false, as both encode chats).
pub fn probes(tokenizer: &ModelPreprocessor, model: &str) -> Result<Vec<Probe>, String> {
    let text = json!({"model": model, "prompt": PROBE_TEXT}).to_string();
    let ids = tokenizer
        .encode_prompt(PROBE_TEXT)
        .map_err(|error| format!("the text probe: {error}"))?;
    let mut probes = vec![Probe {
        name: "text",
        body: text,
        ids,
    }];
    if !tokenizer.has_chat_template() {
        return Ok(probes);
    }
    let chats = [
        (
            "chat",
            json!([
                {"role": "system", "content": PROBE_SYSTEM},
                {"role": "user", "content": PROBE_TEXT},
            ]),
        ),
        (
            "chat_multi_turn",
            json!([
                {"role": "user", "content": "What is a KV cache?"},
                {"role": "assistant", "content": "Keys and values of past tokens, kept."},
                {"role": "user", "content": "And a prefix cache?"},
            ]),
        ),
    ];
    for (name, messages) in chats {
        let body = json!({
            "model": model,
            "messages": messages,
            "add_generation_prompt": true,
            "add_special_tokens": false,
        })
        .to_string();
        let ids = ChatRequest::from_slice(body.as_bytes())
            .and_then(|request| tokenizer.chat_token_ids(&request))
            .map_err(|error| format!("the {name} probe: {error}"))?;
        probes.push(Probe { name, body, ids });
    }
    Ok(probes)
}

/// The part of a `/tokenize` answer the check reads.
#[derive(Debug, Deserialize)]
struct TokenizeAnswer {
    tokens: Vec<u32>,
    #[serde(default)]
    count: Option<usize>,
}

/// The token ids of a `/tokenize` answer body; an error when it is not one.
pub fn engine_ids(body: &[u8]) -> Result<Vec<u32>, String> {
    let answer: TokenizeAnswer =
        serde_json::from_slice(body).map_err(|error| format!("not a /tokenize answer: {error}"))?;
    match answer.count {
        Some(count) if count != answer.tokens.len() => Err(format!(
            "a /tokenize answer with count {count} and {} tokens",
            answer.tokens.len()
        )),
        _ => Ok(answer.tokens),
    }
}

/// Where the proxy's ids of a probe first differ from its engine's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TokenizerMismatch {
    /// The probe's name.
    pub probe: &'static str,
    /// The first position at which they differ (the shorter's length when one is a prefix of
    /// the other).
    pub position: usize,
    /// The proxy's id there (`None`: its ids ended).
    pub proxy_token: Option<u32>,
    /// The engine's id there (`None`: its ids ended).
    pub engine_token: Option<u32>,
    /// How many ids the proxy got.
    pub proxy_tokens: usize,
    /// How many ids the engine gave.
    pub engine_tokens: usize,
}

/// Compares `probe`'s ids with the engine's: `None` when they are equal.
pub fn compare(probe: &Probe, engine: &[u32]) -> Option<TokenizerMismatch> {
    let ours = &probe.ids;
    let position = ours
        .iter()
        .zip(engine)
        .position(|(a, b)| a != b)
        .or_else(|| (ours.len() != engine.len()).then(|| ours.len().min(engine.len())))?;
    Some(TokenizerMismatch {
        probe: probe.name,
        position,
        proxy_token: ours.get(position).copied(),
        engine_token: engine.get(position).copied(),
        proxy_tokens: ours.len(),
        engine_tokens: engine.len(),
    })
}

/// How an instance's engine tokenizes compared with the proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerOutcome {
    /// Every probe gave the proxy's ids.
    Agreed,
    /// A probe gave other ids: the instance is scored by predictions alone.
    Mismatched(TokenizerMismatch),
    /// Not compared, and why (the engine has no `/tokenize`, refused the probes, or did not
    /// answer before the deadline).
    Unchecked(String),
}

impl TokenizerOutcome {
    /// Every `outcome` label, in [`Self::index`] order.
    pub const LABELS: [&'static str; 3] = ["agreed", "mismatched", "unchecked"];

    /// Position of its label in [`Self::LABELS`].
    pub fn index(&self) -> usize {
        match self {
            Self::Agreed => 0,
            Self::Mismatched(_) => 1,
            Self::Unchecked(_) => 2,
        }
    }

    /// The `outcome` label of `kvmesh_route_tokenizer_checks_total`.
    pub fn label(&self) -> &'static str {
        Self::LABELS[self.index()]
    }
}

/// The outcomes of one model's tokenizer checks, by instance, and which checks run now.
#[derive(Debug)]
pub struct TokenizerChecks {
    settings: KvTokenizerCheckConfig,
    outcomes: ArcSwap<HashMap<u64, TokenizerOutcome, KeyedState>>,
    /// The mismatched instances alone (read per request, usually empty).
    mismatched: ArcSwap<HashMap<u64, TokenizerMismatch, KeyedState>>,
    running: Mutex<HashSet<u64>>,
}

impl TokenizerChecks {
    /// No outcome yet; checks run as `settings` say.
    pub(crate) fn new(settings: KvTokenizerCheckConfig) -> Self {
        Self {
            settings,
            outcomes: ArcSwap::from_pointee(HashMap::default()),
            mismatched: ArcSwap::from_pointee(HashMap::default()),
            running: Mutex::new(HashSet::new()),
        }
    }

    /// `kv.tokenizer_check`.
    pub fn settings(&self) -> &KvTokenizerCheckConfig {
        &self.settings
    }

    /// Starts checking instance `instance`: `None` when it has an outcome already or a check
    /// of it runs. The check counts as running until the returned guard drops.
    pub fn start(&self, instance: u64) -> Option<RunningCheck<'_>> {
        if self.outcome(instance).is_some() {
            return None;
        }
        let started = self
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(instance);
        // Built only when started: dropping a guard that did not start would end the check
        // that did.
        if !started {
            return None;
        }
        Some(RunningCheck {
            checks: self,
            instance,
        })
    }

    /// Instance `instance`'s outcome (`None`: not checked yet, or it left).
    pub fn outcome(&self, instance: u64) -> Option<TokenizerOutcome> {
        self.outcomes.load().get(&instance).cloned()
    }

    /// Where instance `instance`'s engine tokenizes otherwise, if it does.
    #[inline]
    pub fn mismatch(&self, instance: u64) -> Option<TokenizerMismatch> {
        let mismatched = self.mismatched.load();
        if mismatched.is_empty() {
            return None;
        }
        mismatched.get(&instance).cloned()
    }

    /// Whether instance `instance`'s engine tokenizes otherwise.
    #[inline]
    pub(crate) fn is_mismatched(&self, instance: u64) -> bool {
        let mismatched = self.mismatched.load();
        !mismatched.is_empty() && mismatched.contains_key(&instance)
    }

    /// Records instance `instance`'s outcome.
    pub(crate) fn record(&self, instance: u64, outcome: TokenizerOutcome) {
        let mismatch = match &outcome {
            TokenizerOutcome::Mismatched(mismatch) => Some(mismatch.clone()),
            TokenizerOutcome::Agreed | TokenizerOutcome::Unchecked(_) => None,
        };
        self.outcomes.rcu(|current| {
            let mut next = HashMap::clone(current);
            next.insert(instance, outcome.clone());
            next
        });
        self.set_mismatch(instance, mismatch);
    }

    /// Forgets instance `instance` (it left the pool).
    pub(crate) fn forget(&self, instance: u64) {
        if self.outcomes.load().contains_key(&instance) {
            self.outcomes.rcu(|current| {
                let mut next = HashMap::clone(current);
                next.remove(&instance);
                next
            });
        }
        self.set_mismatch(instance, None);
    }

    fn set_mismatch(&self, instance: u64, mismatch: Option<TokenizerMismatch>) {
        if self.mismatched.load().get(&instance) == mismatch.as_ref() {
            return;
        }
        self.mismatched.rcu(|current| {
            let mut next = HashMap::clone(current);
            match &mismatch {
                Some(mismatch) => next.insert(instance, mismatch.clone()),
                None => next.remove(&instance),
            };
            next
        });
    }
}

/// A check of one instance in progress ([`TokenizerChecks::start`]); dropping it (the check
/// ended or was aborted) lets another start.
#[derive(Debug)]
pub struct RunningCheck<'a> {
    checks: &'a TokenizerChecks,
    instance: u64,
}

impl Drop for RunningCheck<'_> {
    fn drop(&mut self) {
        self.checks
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.instance);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(ids: &[u32]) -> Probe {
        Probe {
            name: "text",
            body: String::new(),
            ids: ids.to_vec(),
        }
    }

    #[test]
    fn equal_ids_agree_and_the_first_difference_is_named() {
        assert_eq!(compare(&probe(&[1, 2, 3]), &[1, 2, 3]), None);
        assert_eq!(compare(&probe(&[]), &[]), None);
        let differs = compare(&probe(&[1, 2, 3, 4]), &[1, 2, 9, 4]).unwrap();
        assert_eq!(
            differs,
            TokenizerMismatch {
                probe: "text",
                position: 2,
                proxy_token: Some(3),
                engine_token: Some(9),
                proxy_tokens: 4,
                engine_tokens: 4,
            }
        );
        // One a prefix of the other (a BOS the other side adds or not at the end, a
        // generation prompt left out): the shorter's length.
        let shorter = compare(&probe(&[1, 2, 3]), &[1, 2, 3, 7, 8]).unwrap();
        assert_eq!(
            (shorter.position, shorter.proxy_token, shorter.engine_token),
            (3, None, Some(7))
        );
        let longer = compare(&probe(&[1, 2, 3]), &[1, 2]).unwrap();
        assert_eq!(
            (longer.position, longer.proxy_token, longer.engine_token),
            (2, Some(3), None)
        );
        let bos = compare(&probe(&[5, 6]), &[0, 5, 6]).unwrap();
        assert_eq!(bos.position, 0);
    }

    #[test]
    fn reads_vllms_tokenize_answer() {
        let body =
            br#"{"count":3,"max_model_len":4096,"tokens":[785,3974,13876],"token_strs":null}"#;
        assert_eq!(engine_ids(body), Ok(vec![785, 3974, 13876]));
        assert_eq!(engine_ids(br#"{"tokens":[]}"#), Ok(vec![]));
        assert!(engine_ids(br#"{"count":2,"tokens":[1]}"#).is_err());
        assert!(engine_ids(br#"{"detail":"Not Found"}"#).is_err());
        assert!(engine_ids(b"<html>").is_err());
    }

    #[test]
    fn a_mismatched_instance_is_scored_by_predictions_alone_whatever_its_block_size() {
        use crate::kv::{BlockSizeFit, KvRouter};
        use crate::metrics::KvFamilies;
        use kvmesh_config::KvRoutingConfig;

        let families = KvFamilies::register(&prometheus::Registry::new()).unwrap();
        let config = KvRoutingConfig {
            block_size: Some(16),
            ..KvRoutingConfig::default()
        };
        let router = KvRouter::new(&config, None, false, true, families.model("m")).unwrap();
        let feed = router.event_feed().expect("KV events").clone();
        let mismatch = compare(&probe(&[1, 2]), &[1, 3]).unwrap();
        router.record_tokenizer_check(1, TokenizerOutcome::Mismatched(mismatch));
        router.record_tokenizer_check(2, TokenizerOutcome::Agreed);
        assert!(feed.is_approximate_only(1) && !feed.is_approximate_only(2));
        // Its block size fits: still approximate; another instance's conflict stays when its
        // tokenizer agrees.
        assert_eq!(router.fit_block_size(1, 16), BlockSizeFit::Matches);
        assert!(feed.is_approximate_only(1));
        assert_eq!(
            router.fit_block_size(3, 32),
            BlockSizeFit::Differs { model: 16 }
        );
        router.record_tokenizer_check(3, TokenizerOutcome::Agreed);
        assert!(feed.is_approximate_only(3));
        // It leaves: nothing remembered.
        router.remove_instance(1);
        assert!(!feed.is_approximate_only(1));
        assert_eq!(router.tokenizer_checks().outcome(1), None);
    }

    #[test]
    fn outcomes_are_kept_per_instance_and_a_mismatch_is_read_apart() {
        let checks = TokenizerChecks::new(KvTokenizerCheckConfig::default());
        assert!(checks.settings().enabled);
        let running = checks.start(1).expect("not checked yet");
        assert!(checks.start(1).is_none(), "one check at a time");
        drop(running);
        let running = checks.start(1).expect("the aborted check may start again");
        checks.record(1, TokenizerOutcome::Agreed);
        drop(running);
        assert!(checks.start(1).is_none(), "checked once");
        assert_eq!(checks.outcome(1), Some(TokenizerOutcome::Agreed));
        assert_eq!(checks.mismatch(1), None);
        let mismatch = compare(&probe(&[1, 2]), &[1, 3]).unwrap();
        checks.record(2, TokenizerOutcome::Mismatched(mismatch.clone()));
        checks.record(3, TokenizerOutcome::Unchecked("no /tokenize (404)".into()));
        assert_eq!(checks.mismatch(2), Some(mismatch));
        assert!(checks.is_mismatched(2) && !checks.is_mismatched(1) && !checks.is_mismatched(3));
        assert_eq!(
            [1, 2, 3].map(|i| checks.outcome(i).unwrap().label()),
            ["agreed", "mismatched", "unchecked"]
        );
        checks.forget(2);
        assert_eq!((checks.outcome(2), checks.is_mismatched(2)), (None, false));
        assert!(checks.start(2).is_some(), "it may register again");
    }
}

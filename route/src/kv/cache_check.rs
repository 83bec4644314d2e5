//! The router checking its KV index against the engines' own accounting (`kv.cache_check`).
//!
//! Every answer whose usage carries `prompt_tokens_details.cached_tokens` says how many of
//! the prompt's blocks its engine really had cached. Under live KV events, the routing
//! decision wrote down what the index expected for the chosen instance ([`Expectation`]),
//! and the answer is judged against it:
//!
//! - **Expected**: the overlap the engine *reported* (its KV events, without this proxy's
//!   predictions), capped as vLLM caps a full hit: the last prompt token is always computed,
//!   so at most ⌊(prompt tokens − 1) / block size⌋ blocks count.
//! - **Allowed for**: while other requests run on the instance, or one ended less than
//!   [`SETTLE_GRACE`] before, the engine may hold blocks whose events are still on their way
//!   (a sibling prefilling the same prefix): up to the overlap this proxy predicted from its
//!   own decisions still agrees. On a settled instance the reported overlap must be exact.
//! - **Disagreement**: fewer blocks than expected (the index holds blocks the engine
//!   evicted: removals were lost) or more than allowed (the engine holds blocks the index
//!   never heard of: stores were lost).
//!
//! When `mismatches` of an instance's last `window` judged answers disagreed, the instance
//! is **untrusted**: scored by predictions alone (as without events) and resynced from its
//! agent's snapshot; the resync's answer makes it trusted again with an empty window.
//! Answers with usage but without `cached_tokens` (vLLM without
//! `--enable-prompt-tokens-details`) are counted and shown, never judged. Not judged at all:
//! a disaggregated request's decode leg (it reports 0 for the KV it pulled), a migrated
//! stream's continuation, an instance scored approximately for its block size.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kvmesh_config::KvCacheCheckConfig;
use kvmesh_kv::KeyedState;
use serde::Serialize;

/// How long after an instance's last request ended its KV events may still be on their way
/// (engine → agent → bus → intake takes milliseconds; this leaves room for a slow hop).
pub(crate) const SETTLE_GRACE: Duration = Duration::from_millis(250);

/// What a routing decision expects the chosen instance's answer to report cached, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Expectation {
    /// The overlap its engine reported (KV events), capped.
    pub(crate) reported: u32,
    /// The most that agrees: `reported`, or on an instance with requests in flight (or just
    /// ended) the overlap predicted with this proxy's own decisions, capped.
    pub(crate) allowed: u32,
    /// The full-hit cap: ⌊(prompt tokens − 1) / block size⌋.
    pub(crate) cap: u32,
    /// Tokens per block.
    pub(crate) block_size: u32,
}

impl Expectation {
    /// The blocks an answer reporting `cached_tokens` had cached (capped like the expectation).
    pub(crate) fn actual_blocks(&self, cached_tokens: u64) -> u32 {
        let blocks = cached_tokens / u64::from(self.block_size.max(1));
        u32::try_from(blocks).unwrap_or(u32::MAX).min(self.cap)
    }

    /// Whether `actual` blocks agree with the expectation.
    fn agrees(&self, actual: u32) -> bool {
        (self.reported..=self.allowed.max(self.reported)).contains(&actual)
    }
}

/// What judging one answer found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The engine had what the index expected.
    Agreed,
    /// It did not.
    Disagreed,
    /// It did not, and with it the instance's window holds `mismatches` disagreements: the
    /// instance is untrusted from now on.
    Tripped,
}

/// One judged answer, as `/debug/route` shows the last one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CheckedAnswer {
    /// Blocks the index expected (the engine's reported overlap, capped).
    pub expected_blocks: u32,
    /// Blocks the engine said it had cached (`cached_tokens / block_size`, capped).
    pub actual_blocks: u32,
}

/// One instance's check, as `/debug/route` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CacheCheckState {
    /// Answers judged since the instance joined.
    pub judged: u64,
    /// Of them, those that disagreed.
    pub disagreed: u64,
    /// Disagreements among the last `window` judged answers.
    pub recent_disagreements: usize,
    /// Judged answers the window holds (at most `kv.cache_check.window`).
    pub recent: usize,
    /// Answers with usage but without `cached_tokens`: its engine cannot be checked (vLLM
    /// needs `--enable-prompt-tokens-details`).
    pub without_cached_tokens: u64,
    /// The last judged answer.
    pub last: Option<CheckedAnswer>,
    /// Scored by predictions alone until its resync answers.
    pub untrusted: bool,
}

#[derive(Debug, Default)]
struct InstanceCheck {
    /// The last judged answers, oldest first: whether each disagreed.
    recent: VecDeque<bool>,
    judged: u64,
    disagreed: u64,
    without_details: u64,
    last: Option<CheckedAnswer>,
    untrusted: bool,
}

/// The check of one model's instances.
#[derive(Debug)]
pub(crate) struct CacheCheck {
    window: usize,
    mismatches: usize,
    instances: Mutex<HashMap<u64, InstanceCheck, KeyedState>>,
}

impl CacheCheck {
    /// A check with `config`'s window (0: off).
    pub(crate) fn new(config: &KvCacheCheckConfig) -> Self {
        Self {
            window: config.window,
            mismatches: config.mismatches.max(1),
            instances: Mutex::new(HashMap::default()),
        }
    }

    /// Whether answers are judged at all.
    pub(crate) fn is_on(&self) -> bool {
        self.window > 0
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, InstanceCheck, KeyedState>> {
        self.instances
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Judges an answer of instance `instance` that reported `actual` blocks cached against
    /// `expected`. An untrusted instance's answers are not judged (`None`).
    pub(crate) fn judge(
        &self,
        instance: u64,
        expected: &Expectation,
        actual: u32,
    ) -> Option<Verdict> {
        let mut instances = self.lock();
        let check = instances.entry(instance).or_default();
        if check.untrusted || !self.is_on() {
            return None;
        }
        let disagrees = !expected.agrees(actual);
        check.judged += 1;
        check.disagreed += u64::from(disagrees);
        check.last = Some(CheckedAnswer {
            expected_blocks: expected.reported,
            actual_blocks: actual,
        });
        if check.recent.len() == self.window {
            check.recent.pop_front();
        }
        check.recent.push_back(disagrees);
        if !disagrees {
            return Some(Verdict::Agreed);
        }
        let recent = check.recent.iter().filter(|&&d| d).count();
        if recent >= self.mismatches {
            check.untrusted = true;
            return Some(Verdict::Tripped);
        }
        Some(Verdict::Disagreed)
    }

    /// Counts an answer of `instance` with usage but without `cached_tokens`; returns whether
    /// it was its first.
    pub(crate) fn without_details(&self, instance: u64) -> bool {
        let mut instances = self.lock();
        let check = instances.entry(instance).or_default();
        check.without_details += 1;
        check.without_details == 1
    }

    /// Instance `instance` was resynced: trusted again, with an empty window.
    pub(crate) fn trusted(&self, instance: u64) {
        if let Some(check) = self.lock().get_mut(&instance) {
            check.untrusted = false;
            check.recent.clear();
        }
    }

    /// Forgets instance `instance` (it left).
    pub(crate) fn forget(&self, instance: u64) {
        self.lock().remove(&instance);
    }

    /// Instance `instance`'s check (`None`: off, or nothing counted yet).
    pub(crate) fn state(&self, instance: u64) -> Option<CacheCheckState> {
        if !self.is_on() {
            return None;
        }
        let instances = self.lock();
        let check = instances.get(&instance)?;
        Some(CacheCheckState {
            judged: check.judged,
            disagreed: check.disagreed,
            recent_disagreements: check.recent.iter().filter(|&&d| d).count(),
            recent: check.recent.len(),
            without_cached_tokens: check.without_details,
            last: check.last,
            untrusted: check.untrusted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(window: usize, mismatches: usize) -> CacheCheck {
        CacheCheck::new(&KvCacheCheckConfig { window, mismatches })
    }

    fn expect(reported: u32, allowed: u32) -> Expectation {
        Expectation {
            reported,
            allowed,
            cap: 10,
            block_size: 16,
        }
    }

    #[test]
    fn an_answer_agrees_between_the_reported_and_the_allowed_overlap() {
        let settled = expect(4, 4);
        assert!(settled.agrees(4));
        assert!(!settled.agrees(3), "fewer: the index kept evicted blocks");
        assert!(!settled.agrees(5), "more: the index missed stored blocks");
        let busy = expect(4, 7);
        assert!(busy.agrees(4) && busy.agrees(7));
        assert!(!busy.agrees(3) && !busy.agrees(8));
    }

    #[test]
    fn actual_blocks_are_whole_blocks_under_the_full_hit_cap() {
        let e = expect(0, 0);
        assert_eq!(e.actual_blocks(0), 0);
        assert_eq!(e.actual_blocks(47), 2);
        assert_eq!(e.actual_blocks(48), 3);
        assert_eq!(e.actual_blocks(10_000), 10, "capped");
    }

    #[test]
    fn n_of_the_last_m_disagreements_trip_and_a_resync_restores_trust() {
        let check = check(4, 2);
        let e = expect(2, 2);
        assert_eq!(check.judge(1, &e, 2), Some(Verdict::Agreed));
        assert_eq!(check.judge(1, &e, 0), Some(Verdict::Disagreed));
        for _ in 0..3 {
            assert_eq!(check.judge(1, &e, 2), Some(Verdict::Agreed));
        }
        // The first disagreement left the window of 4: one in it again does not trip.
        assert_eq!(check.judge(1, &e, 5), Some(Verdict::Disagreed));
        assert_eq!(check.judge(1, &e, 5), Some(Verdict::Tripped));
        assert_eq!(check.judge(1, &e, 2), None, "untrusted: not judged");
        let state = check.state(1).unwrap();
        assert_eq!((state.judged, state.disagreed), (7, 3));
        assert_eq!((state.recent, state.recent_disagreements), (4, 2));
        assert!(state.untrusted);
        assert_eq!(
            state.last,
            Some(CheckedAnswer {
                expected_blocks: 2,
                actual_blocks: 5
            })
        );
        check.trusted(1);
        let state = check.state(1).unwrap();
        assert!(!state.untrusted);
        assert_eq!(state.recent, 0);
        assert_eq!(check.judge(1, &e, 5), Some(Verdict::Disagreed));
        assert_eq!(check.judge(2, &e, 2), Some(Verdict::Agreed), "per instance");
    }

    #[test]
    fn answers_without_cached_tokens_are_counted_not_judged() {
        let check = check(8, 3);
        assert!(check.without_details(1));
        assert!(!check.without_details(1));
        let state = check.state(1).unwrap();
        assert_eq!((state.without_cached_tokens, state.judged), (2, 0));
        check.forget(1);
        assert_eq!(check.state(1), None);
    }

    #[test]
    fn a_window_of_zero_turns_the_check_off() {
        let check = check(0, 0);
        assert!(!check.is_on());
        assert_eq!(check.judge(1, &expect(1, 1), 0), None);
        assert_eq!(check.state(1), None);
    }
}

//! Choosing a model's pool for a request (models with `pools`), as Dynamo's global router
//! does: the first pool, in order, whose `max_input_tokens` the prompt fits; when its best
//! instance is predicted to give a first token later than its `ttft_target_ms`, or a time
//! between tokens longer than its `itl_target_ms`, and a later pool that takes the prompt is
//! predicted within both, that pool. The front ends' request paths (the proxy's spine and the
//! endpoint picker) ask this one decision, then pick among the chosen pool's instances.

use std::sync::Arc;

use kvmesh_config::PoolConfig;

use crate::balancer::Balancer;
use crate::candidates::{Candidate, Candidates, Excluded};
use crate::policy::PolicyInput;

/// The pool a request goes to.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolChoice<'p> {
    /// The pool.
    pub pool: &'p PoolConfig,
    /// Why a later pool than the first that fits: the first's predicted misses, said.
    pub moved: Option<String>,
}

/// The pool of `pools` the request `input` goes to, predicting with `balancer` over
/// `instances` (each in its [`Candidate::pool`]) at clock time `now_ms`; `None`: no pools.
pub fn choose_pool<'p, C: Candidate>(
    balancer: &Balancer,
    pools: &'p [PoolConfig],
    instances: &[Arc<C>],
    input: &PolicyInput,
    now_ms: u64,
) -> Option<PoolChoice<'p>> {
    let tokens = input.prompt_tokens().map(|tokens| tokens as u64);
    let fits = |candidate: &&PoolConfig| match (candidate.max_input_tokens, tokens) {
        (None, _) => true,
        (Some(max), Some(tokens)) => tokens <= max,
        (Some(_), None) => false,
    };
    let fitting: Vec<&PoolConfig> = pools.iter().filter(fits).collect();
    let first = fitting.first().copied().or(pools.last())?;
    let predicting = Predicting {
        balancer,
        instances,
        input,
        now_ms,
    };
    let missed = predicting
        .misses(first, first)
        .filter(|missed| !missed.is_empty());
    if let Some(missed) = missed {
        let within = fitting.iter().skip(1).find(|later| {
            predicting
                .misses(later, first)
                .is_some_and(|missed| missed.is_empty())
        });
        if let Some(within) = within {
            return Some(PoolChoice {
                pool: within,
                moved: Some(format!(
                    "pool {} predicted {}",
                    first.name,
                    missed.join(", ")
                )),
            });
        }
    }
    Some(PoolChoice {
        pool: first,
        moved: None,
    })
}

/// What predicting a pool's best instance needs.
struct Predicting<'a, C> {
    balancer: &'a Balancer,
    instances: &'a [Arc<C>],
    input: &'a PolicyInput,
    now_ms: u64,
}

impl<C: Candidate> Predicting<'_, C> {
    /// The TTFT and ITL targets of `targets` the best instance of `candidate` is predicted
    /// to miss, said (empty: it meets them, or there are none); `None`: nothing predicts.
    fn misses(&self, candidate: &PoolConfig, targets: &PoolConfig) -> Option<Vec<String>> {
        if targets.ttft_target_ms.is_none() && targets.itl_target_ms.is_none() {
            return Some(Vec::new());
        }
        // The ITL is the decode instances'; one prediction serves both where all decode.
        let prefill_only = self.instances.iter().any(|instance| {
            instance.pool() == Some(candidate.name.as_str()) && !instance.decodes()
        });
        let all = self.best(candidate, false)?;
        let decoding = if prefill_only && targets.itl_target_ms.is_some() {
            self.best(candidate, true)?
        } else {
            all
        };
        let mut missed = Vec::new();
        if let Some(target) = targets
            .ttft_target_ms
            .filter(|&target| all.ttft_ms() > target)
        {
            missed.push(format!(
                "{:.0} ms > ttft_target_ms {target:.0}",
                all.ttft_ms()
            ));
        }
        if let Some(target) = targets
            .itl_target_ms
            .filter(|&target| decoding.itl_ms() > target)
        {
            missed.push(format!(
                "{:.1} ms/token > itl_target_ms {target:.1}",
                decoding.itl_ms()
            ));
        }
        Some(missed)
    }

    /// The cost predicted on the instance of `candidate` the policy would choose, among
    /// those that decode when `decoding`.
    fn best(&self, candidate: &PoolConfig, decoding: bool) -> Option<crate::kv::Cost> {
        let outside = Excluded::matching(self.instances, |instance| {
            instance.pool() != Some(candidate.name.as_str()) || (decoding && !instance.decodes())
        });
        let candidates = Candidates::new(self.instances, &outside, self.now_ms);
        self.balancer.predict(&candidates, self.input)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Member;

    impl Candidate for Member {
        fn id(&self) -> u64 {
            0
        }
        fn url(&self) -> &str {
            "http://a"
        }
        fn in_flight(&self) -> u64 {
            0
        }
        fn is_available(&self, _now_ms: u64) -> bool {
            true
        }
    }

    fn pool(name: &str, max_input_tokens: Option<u64>) -> PoolConfig {
        PoolConfig {
            name: name.to_string(),
            max_input_tokens,
            ttft_target_ms: Some(1.0),
            itl_target_ms: None,
        }
    }

    #[test]
    fn the_first_pool_the_prompt_fits_when_nothing_predicts() {
        let balancer = Balancer::load_only(kvmesh_config::PolicyKind::RoundRobin).unwrap();
        let instances = [Arc::new(Member)];
        let pools = [pool("short", Some(100)), pool("long", None)];
        // Without a prompt only a pool without a bound fits; round robin predicts nothing,
        // so no target moves the request.
        let choice = choose_pool(&balancer, &pools, &instances, &PolicyInput::None, 0).unwrap();
        assert_eq!((choice.pool.name.as_str(), choice.moved), ("long", None));
        assert_eq!(
            choose_pool(&balancer, &[], &instances, &PolicyInput::None, 0),
            None
        );
    }
}

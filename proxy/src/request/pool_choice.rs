//! Choosing a model's pool (phase 2a of [`crate::request`], models with `pools`), as Dynamo's
//! global router does: the first pool, in order, whose `max_input_tokens` the prompt fits;
//! when its best instance predicts a first token later than its `ttft_target_ms` and a
//! later pool that takes the prompt predicts one within it, that pool. The request then picks
//! among the chosen pool's instances only (every instance when the pool has none).

use std::sync::Arc;

use kvmesh_config::PoolConfig;
use kvmesh_route::kv::Choice;
use kvmesh_route::{Candidates, Excluded, PolicyInput};

use crate::clock::now_millis;
use crate::instance::Instance;
use crate::pool::{Instances, ModelPool};
use crate::request::prepare::Picker;

/// The pool a request goes to.
#[derive(Debug)]
pub(crate) struct PoolChoice {
    /// The pool's instances (every instance when it has none).
    pub(crate) instances: Instances,
    /// `pool=NAME; ` (and why, when the TTFT target moved it), for the explanation.
    pub(crate) explanation: String,
}

/// The pool of `pool`'s `instances` the request `picker` describes goes to (`None`: the
/// model has no pools).
pub(crate) fn choose_pool(
    pool: &ModelPool,
    instances: &Instances,
    picker: &Picker<'_>,
) -> Option<PoolChoice> {
    let pools = pool.pools();
    if pools.is_empty() {
        return None;
    }
    let tokens = picker.input.prompt_tokens().map(|tokens| tokens as u64);
    let fits = |candidate: &&PoolConfig| match (candidate.max_input_tokens, tokens) {
        (None, _) => true,
        (Some(max), Some(tokens)) => tokens <= max,
        (Some(_), None) => false,
    };
    let fitting: Vec<&PoolConfig> = pools.iter().filter(fits).collect();
    let first = fitting.first().copied().or(pools.last())?;
    let mut chosen = first;
    let mut why = String::new();
    if let Some(target) = first.ttft_target_ms {
        let first_ttft = predicted_ttft(instances, first, picker);
        if first_ttft.is_some_and(|ttft| ttft > target) {
            let faster = fitting.iter().skip(1).find(|later| {
                predicted_ttft(instances, later, picker).is_some_and(|ttft| ttft <= target)
            });
            if let (Some(faster), Some(ttft)) = (faster, first_ttft) {
                why = format!(
                    " (pool {} predicted {ttft:.0} ms > ttft_target_ms {target:.0})",
                    first.name
                );
                chosen = faster;
            }
        }
    }
    let members: Vec<Arc<Instance>> = instances
        .iter()
        .filter(|instance| instance.pool() == Some(chosen.name.as_str()))
        .cloned()
        .collect();
    let (instances, empty) = if members.is_empty() {
        (Arc::clone(instances), " (no instance: all)")
    } else {
        (Arc::new(members), "")
    };
    pool.metrics().pool_chosen(&chosen.name);
    Some(PoolChoice {
        instances,
        explanation: format!("pool={}{why}{empty}; ", chosen.name),
    })
}

/// The time to first token the best instance of `candidate` predicts for the request (`None`:
/// no prompt to predict from, or no instance there).
fn predicted_ttft(
    instances: &[Arc<Instance>],
    candidate: &PoolConfig,
    picker: &Picker<'_>,
) -> Option<f64> {
    let (Some(router), PolicyInput::Kv(request)) = (picker.balancer.kv_router(), &picker.input)
    else {
        return None;
    };
    let outside = Excluded::matching(instances, |instance| {
        instance.pool() != Some(candidate.name.as_str())
    });
    let candidates = Candidates::new(instances, &outside, now_millis());
    match router.choose(&candidates, request, &mut rand::thread_rng()) {
        Choice::Picked(decision) => Some(decision.cost.ttft_ms()),
        Choice::AllBusy | Choice::NoneEligible => None,
    }
}

//! Choosing a model's pool (phase 2a of [`crate::request`], models with `pools`), as Dynamo's
//! global router does: the first pool, in order, whose `max_input_tokens` the prompt fits;
//! when its best instance predicts a first token later than its `ttft_target_ms`, or a time
//! between tokens longer than its `itl_target_ms`, and a later pool that takes the prompt
//! predicts both within them, that pool. The request then picks
//! among the chosen pool's instances only (every instance when the pool has none).

use std::sync::Arc;

use kvmesh_config::PoolConfig;
use kvmesh_route::kv::{Choice, Cost};
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
    if let Some(missed) = missed_targets(instances, first, first, picker) {
        let within = fitting
            .iter()
            .skip(1)
            .find(|later| predicts_within(instances, later, first, picker));
        if let Some(within) = within {
            why = format!(" (pool {} predicted {missed})", first.name);
            chosen = within;
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

/// Which of `targets`' TTFT and ITL targets the best instance of `candidate` is predicted to
/// miss, described (`None`: it meets them, the pool has none, or nothing predicts).
fn missed_targets(
    instances: &[Arc<Instance>],
    candidate: &PoolConfig,
    targets: &PoolConfig,
    picker: &Picker<'_>,
) -> Option<String> {
    let mut missed = Vec::new();
    if let Some(target) = targets.ttft_target_ms {
        let ttft = predicted(instances, candidate, picker, false)?.ttft_ms();
        if ttft > target {
            missed.push(format!("{ttft:.0} ms > ttft_target_ms {target:.0}"));
        }
    }
    if let Some(target) = targets.itl_target_ms {
        let itl = predicted(instances, candidate, picker, true)?.itl_ms();
        if itl > target {
            missed.push(format!("{itl:.1} ms/token > itl_target_ms {target:.1}"));
        }
    }
    (!missed.is_empty()).then(|| missed.join(", "))
}

/// Whether the best instance of `candidate` is predicted to meet `targets`' TTFT and ITL
/// targets (false when nothing predicts).
fn predicts_within(
    instances: &[Arc<Instance>],
    candidate: &PoolConfig,
    targets: &PoolConfig,
    picker: &Picker<'_>,
) -> bool {
    let ttft_met = targets.ttft_target_ms.is_none_or(|target| {
        predicted(instances, candidate, picker, false).is_some_and(|c| c.ttft_ms() <= target)
    });
    ttft_met
        && targets.itl_target_ms.is_none_or(|target| {
            predicted(instances, candidate, picker, true).is_some_and(|c| c.itl_ms() <= target)
        })
}

/// The cost the KV policy predicts for the request on the instance of `candidate` it would
/// choose, among those that decode when `decoding` (the ITL is the decode engine's); `None`:
/// no prompt to predict from, or no instance there.
fn predicted(
    instances: &[Arc<Instance>],
    candidate: &PoolConfig,
    picker: &Picker<'_>,
    decoding: bool,
) -> Option<Cost> {
    let (Some(router), PolicyInput::Kv(request)) = (picker.balancer.kv_router(), &picker.input)
    else {
        return None;
    };
    let outside = Excluded::matching(instances, |instance| {
        instance.pool() != Some(candidate.name.as_str()) || (decoding && !instance.role().decodes())
    });
    let candidates = Candidates::new(instances, &outside, now_millis());
    match router.choose(&candidates, request, &mut rand::thread_rng()) {
        Choice::Picked(decision) => Some(decision.cost),
        Choice::AllBusy | Choice::NoneEligible => None,
    }
}

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
    let missed = misses(instances, first, first, picker).filter(|missed| !missed.is_empty());
    if let Some(missed) = missed {
        let within = fitting.iter().skip(1).find(|later| {
            misses(instances, later, first, picker).is_some_and(|missed| missed.is_empty())
        });
        if let Some(within) = within {
            why = format!(" (pool {} predicted {})", first.name, missed.join(", "));
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

/// The TTFT and ITL targets of `targets` the best instance of `candidate` is predicted to
/// miss, described (empty: it meets them, or there are none); `None` when nothing predicts.
fn misses(
    instances: &[Arc<Instance>],
    candidate: &PoolConfig,
    targets: &PoolConfig,
    picker: &Picker<'_>,
) -> Option<Vec<String>> {
    if targets.ttft_target_ms.is_none() && targets.itl_target_ms.is_none() {
        return Some(Vec::new());
    }
    // The ITL is the decode instances'; one prediction serves both where every member decodes.
    let prefill_only = instances.iter().any(|instance| {
        instance.pool() == Some(candidate.name.as_str()) && !instance.role().decodes()
    });
    let all = predicted(instances, candidate, picker, false)?;
    let decoding = if prefill_only && targets.itl_target_ms.is_some() {
        predicted(instances, candidate, picker, true)?
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

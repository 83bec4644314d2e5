//! Choosing a model's pool (phase 2a of [`crate::request`], models with `pools`): the
//! routing decision [`kvmesh_route::choose_pool`], then the chosen pool's instances (every
//! instance when the pool has none), counted and explained.

use std::sync::Arc;

use crate::engines::clock::now_millis;
use crate::engines::instance::Instance;
use crate::engines::pool::{Instances, ModelPool};
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
    let choice = kvmesh_route::choose_pool(
        picker.balancer,
        pool.pools(),
        instances,
        &picker.input,
        now_millis(),
    )?;
    let chosen = choice.pool.name.as_str();
    let members: Vec<Arc<Instance>> = instances
        .iter()
        .filter(|instance| instance.pool() == Some(chosen))
        .cloned()
        .collect();
    let (instances, empty) = if members.is_empty() {
        (Arc::clone(instances), " (no instance: all)")
    } else {
        (Arc::new(members), "")
    };
    pool.metrics().pool_chosen(chosen);
    let why = choice
        .moved
        .map(|moved| format!(" ({moved})"))
        .unwrap_or_default();
    Some(PoolChoice {
        instances,
        explanation: format!("pool={chosen}{why}{empty}; "),
    })
}

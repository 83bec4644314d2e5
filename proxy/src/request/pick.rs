//! Queueing and picking (phases 3 and 4 of [`crate::request`]): a request waits in the
//! policy's bounded queue while every instance is busy (`policy: kv`); then the policy names
//! the next instance not tried yet, booking the request's load on it (`policy: kv`). Once
//! the answer is whole, its usage goes back to the booking ([`report_cached`]).

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderValue;
use kvmesh_route::kv::{Booking, Steer};
use kvmesh_route::{Candidates, Excluded, NoPick, PolicyInput};
use kvmesh_wire::usage::TokenCount;

use crate::engines::clock::now_millis;
use crate::engines::instance::Instance;
use crate::engines::pool::ModelPool;
use crate::openai::api_error::ApiError;
use crate::request::frontend::unless;
use crate::request::prepare::Picker;
use crate::request::stop::Stop;

/// Seconds a client should wait after a 503 because every instance was busy.
const BUSY_RETRY_AFTER_SECS: u64 = 1;

/// The instance chosen for one attempt, and what `policy: kv` booked for it.
pub(crate) struct Pick<'a> {
    /// Its index in the instances the request picks from.
    pub(crate) index: usize,
    /// The instance.
    pub(crate) instance: Arc<Instance>,
    /// The load `policy: kv` booked for the request.
    pub(crate) booking: Option<Booking<'a>>,
    /// `x-kvmesh-route` (`policy: kv` only).
    pub(crate) route: Option<HeaderValue>,
    /// The data-parallel rank the request is sent to (`policy: kv` with KV events, on an
    /// instance with several ranks; `None`: the engine chooses).
    pub(crate) dp_rank: Option<u32>,
}

/// Waits (bounded, unless the client leaves first: `gone` completes) while every instance
/// is busy; `Err`: the 503 to answer. Only `policy: kv` queues: other policies cost no wait.
/// The spine and the endpoint picker both queue here.
pub(crate) async fn queue(
    pool: &ModelPool,
    instances: &[Arc<Instance>],
    picker: &Picker<'_>,
    gone: impl Future<Output = ()>,
) -> Result<(), Stop> {
    if !picker.balancer.queues() {
        return Ok(());
    }
    match unless(gone, picker.balancer.admit(instances, now_millis)).await {
        None => Err(Stop::ClientGone),
        Some(admitted) => {
            admitted.map_err(|rejected| Stop::Answer(overloaded(pool, rejected.describe())))
        }
    }
}

/// The instances that take no decode legs (prefill only), excluded from a disaggregated
/// model's decode picks.
pub(crate) fn prefill_only(instances: &[Arc<Instance>]) -> Excluded {
    Excluded::matching(instances, |instance| !instance.role().decodes())
}

/// What every pick of a whole request (or a decode leg) of `pool` leaves out of `instances`:
/// the instances that only prefill. `Err` when that leaves nothing of a model that is not
/// disaggregated: the 503 naming the cause.
pub(crate) fn whole_request_exclusions(
    pool: &ModelPool,
    instances: &[Arc<Instance>],
) -> Result<Excluded, ApiError> {
    let excluded = prefill_only(instances);
    if pool.disaggregation().is_none() && !instances.is_empty() && excluded.len() == instances.len()
    {
        return Err(ApiError::OnlyPrefillInstances {
            model: pool.name().to_string(),
        });
    }
    Ok(excluded)
}

/// Asks the model's decider, another proxy replica, which of `instances` not in `excluded`
/// to route the request to (`policy: kv` with a prompt, while a replica with a lower id
/// shares its load: [`kvmesh_route::kv::KvRouter::ask_decider`]); `None`: [`pick`] decides
/// here.
pub(crate) async fn steer(
    instances: &[Arc<Instance>],
    picker: &Picker<'_>,
    excluded: &Excluded,
) -> Option<Steer> {
    let router = picker.balancer.kv_router()?;
    let PolicyInput::Kv(request) = &picker.input else {
        return None;
    };
    let candidates = Candidates::new(instances, excluded, now_millis());
    router.ask_decider(&candidates, request).await
}

/// Picks the next instance of `instances` (the pool's, loaded once per request) not in
/// `excluded`: the one `steer` names when it may ([`steer`]).
pub(crate) fn pick<'a>(
    instances: &[Arc<Instance>],
    picker: &Picker<'a>,
    excluded: &Excluded,
    steer: Option<Steer>,
) -> Result<Pick<'a>, NoPick> {
    let candidates = Candidates::new(instances, excluded, now_millis());
    let picked = picker
        .balancer
        .pick_steered(&candidates, &picker.input, steer)?;
    let instance = instances.get(picked.index).ok_or(NoPick::Nothing)?;
    let ranks = instance.dp_ranks();
    Ok(Pick {
        index: picked.index,
        instance: Arc::clone(instance),
        booking: picked.booking,
        route: picked.explanation.map(route_header),
        dp_rank: picked.dp_rank.filter(|&rank| ranks > 1 && rank < ranks),
    })
}

/// Hands the engine's usage in `tokens` (a whole answer to the prompt `pick` was made for)
/// to its booking, which judges the KV index by the answer's `cached_tokens` (`policy: kv`
/// under live KV events; an answer without usage says nothing).
pub(crate) fn report_cached(pick: &Pick<'_>, tokens: &TokenCount) {
    if let Some(booking) = &pick.booking
        && tokens.prompt_tokens().is_some()
    {
        booking.engine_cached(pick.instance.url().as_str(), tokens.cached_tokens());
    }
}

/// `x-kvmesh-route` with `explanation` as its value.
fn route_header(explanation: String) -> HeaderValue {
    HeaderValue::from_maybe_shared(Bytes::from(explanation))
        .unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// The 503 for a model whose instances are all busy.
pub(crate) fn overloaded(pool: &ModelPool, reason: &'static str) -> ApiError {
    ApiError::Overloaded {
        model: pool.name().to_string(),
        reason,
        retry_after_secs: BUSY_RETRY_AFTER_SECS,
    }
}

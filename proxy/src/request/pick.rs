//! Queueing and picking (phases 3 and 4 of [`crate::request`]): under `policy: kv` a
//! request waits in the bounded queue while every instance is busy; then the picker names
//! the next instance not tried yet, and `policy: kv` books the request's load on it.

use std::sync::Arc;
use std::time::Instant;

use http::HeaderValue;

use crate::api_error::ApiError;
use crate::clock::now_millis;
use crate::instance::Instance;
use crate::kv_route::Choice;
use crate::kv_route::booking::Booking;
use crate::kv_route::explain::route_header;
use crate::policy::Excluded;
use crate::pool::ModelPool;
use crate::request::prepare::Picker;

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
}

/// Why no instance was picked.
pub(crate) enum NoPick {
    /// Nothing is available.
    Nothing,
    /// Every available instance is busy.
    Busy,
}

/// Under `policy: kv`, waits (bounded) while every instance is busy; `Err`: the 503 to
/// answer.
pub(crate) async fn queue(
    pool: &ModelPool,
    instances: &[Arc<Instance>],
    picker: &Picker<'_>,
) -> Result<(), ApiError> {
    let Picker::Kv { router, .. } = picker else {
        return Ok(());
    };
    router
        .admit(instances, now_millis)
        .await
        .map_err(|rejected| overloaded(pool, rejected.describe()))
}

/// Picks the next instance of `instances` (the pool's, loaded once per request) not in
/// `excluded`.
pub(crate) fn pick<'a>(
    instances: &[Arc<Instance>],
    picker: &'a Picker<'a>,
    excluded: &Excluded,
) -> Result<Pick<'a>, NoPick> {
    match picker {
        Picker::Policy(policy) => match ModelPool::pick(instances, *policy, excluded) {
            Some((index, instance)) => Ok(Pick {
                index,
                instance: Arc::clone(instance),
                booking: None,
                route: None,
            }),
            None => Err(NoPick::Nothing),
        },
        Picker::Kv { router, request } => {
            let choice = router.choose(
                instances,
                request,
                excluded,
                now_millis(),
                &mut rand::thread_rng(),
            );
            match choice {
                Choice::Picked(decision) => {
                    let Some(instance) = instances.get(decision.index) else {
                        return Err(NoPick::Nothing);
                    };
                    let booking = router.commit(&decision, request, Instant::now());
                    Ok(Pick {
                        index: decision.index,
                        route: Some(route_header(instance.url().as_str(), &decision, request)),
                        instance: Arc::clone(instance),
                        booking: Some(booking),
                    })
                }
                Choice::AllBusy => {
                    router.count_busy_rejection();
                    Err(NoPick::Busy)
                }
                Choice::NoneEligible => Err(NoPick::Nothing),
            }
        }
    }
}

/// The 503 for a model whose instances are all busy.
pub(crate) fn overloaded(pool: &ModelPool, reason: &'static str) -> ApiError {
    ApiError::Overloaded {
        model: pool.name().to_string(),
        reason,
        retry_after_secs: BUSY_RETRY_AFTER_SECS,
    }
}

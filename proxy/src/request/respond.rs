//! Judging the engine's response (phase 6 of [`crate::request`]): its status goes into the
//! record, and a 5xx counts towards the instance's ejection. (Whether a retryable status is
//! tried again elsewhere is [`crate::request::attempt::Failover::retries_status`]'s call.)

use crate::clock::now_millis;
use crate::failure::FailureKind;
use crate::instance::Instance;
use crate::request::record::Record;
use crate::state::State;
use crate::upstream_session::UpstreamSession;

/// Records the status of `engine`'s response from `instance`; `None` when it has none.
pub(crate) fn judge(
    state: &State,
    instance: &Instance,
    engine: &UpstreamSession,
    record: &mut Record,
) -> Option<u16> {
    let status = engine.status()?;
    record.status = status;
    if status >= 500 {
        instance.record_failure(FailureKind::Status5xx, &state.outlier, now_millis());
    } else {
        instance.record_success();
    }
    Some(status)
}

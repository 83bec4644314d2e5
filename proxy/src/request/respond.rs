//! Judging the engine's response (phase 6 of [`crate::request`]): a 5xx counts towards the
//! instance's ejection. (Whether a retryable status is
//! tried again elsewhere is [`crate::request::attempt::Failover::retries_status`]'s call.)

use crate::engines::clock::now_millis;
use crate::engines::instance::Instance;
use crate::engines::upstream_session::UpstreamSession;
use crate::metrics::failure::FailureKind;
use crate::state::shared::State;

/// The status of `engine`'s response from `instance`, counted for its ejection; `None` when
/// it has none.
pub(crate) fn judge(state: &State, instance: &Instance, engine: &UpstreamSession) -> Option<u16> {
    let status = engine.status()?;
    if status >= 500 {
        instance.record_failure(FailureKind::Status5xx, &state.outlier, now_millis());
    } else {
        instance.record_success();
    }
    Some(status)
}

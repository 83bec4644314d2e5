//! Judging the engine's response (phase 6 of [`crate::request`]): its status goes into the
//! record, and a 5xx counts towards the instance's ejection.

use crate::clock::now_millis;
use crate::failure::FailureKind;
use crate::instance::Instance;
use crate::request::record::Record;
use crate::state::State;
use crate::upstream_session::UpstreamSession;

/// Records the status of `engine`'s response from `instance`; `false` when it has none.
pub(crate) fn judge(
    state: &State,
    instance: &Instance,
    engine: &UpstreamSession,
    record: &mut Record,
) -> bool {
    let Some(status) = engine.status() else {
        return false;
    };
    record.status = status;
    if status >= 500 {
        instance.record_failure(FailureKind::Status5xx, &state.outlier, now_millis());
    } else {
        instance.record_success();
    }
    true
}

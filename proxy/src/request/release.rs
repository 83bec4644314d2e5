//! Releasing what a request held once its relay ended (phase 8 of [`crate::request`]): the
//! engine connection goes back to the pool after a complete answer; a broken one counts
//! towards the instance's ejection. (The load `policy: kv` booked, the instance's
//! in-flight count and the model's concurrency slot are guards, released when the spine
//! drops them.)

use crate::engines::clock::now_millis;
use crate::engines::instance::Instance;
use crate::engines::upstream_session::UpstreamSession;
use crate::request::record::Record;
use crate::request::relay::RelayEnd;
use crate::state::shared::State;

/// Releases the engine connection after a relay that ended with `end`; returns whether the
/// client connection is still in a reusable state.
pub(crate) async fn release(
    state: &State,
    instance: &Instance,
    engine: UpstreamSession,
    end: RelayEnd,
    record: &mut Record,
) -> bool {
    match end {
        RelayEnd::Complete | RelayEnd::ChoiceDone => {
            state.upstream.release(engine, instance.peer()).await;
            true
        }
        RelayEnd::UpstreamFailed { kind, clean } => {
            instance.record_failure(kind, &state.outlier, now_millis());
            record.upstream_failure = Some(kind);
            clean
        }
        RelayEnd::ClientGone => {
            record.client_gone = true;
            false
        }
        // The spine migrates a broken stream or ends it before releasing; a break that
        // reaches here left the client's answer unfinished.
        RelayEnd::Broken(kind) => {
            instance.record_failure(kind, &state.outlier, now_millis());
            record.upstream_failure = Some(kind);
            false
        }
    }
}

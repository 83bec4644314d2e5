//! Recording a decision's prediction (step 5 of [`crate::kv`]): the chosen instance will hold
//! the prompt's blocks. A long prompt is recorded in steps.
//!
//! Recording a block costs about a quarter of a microsecond (a map probe and a heap push
//! under the model's prediction lock), so a 100k-token prompt's 1,560 blocks held the thread
//! that picked it for about 0.4 ms in one piece, and every request waiting on that reactor
//! thread waited that long (`benches/long-prompts.sh`). Now the first [`RECORD_STEP`] blocks
//! are recorded with the decision, and a task records the rest [`RECORD_STEP`] at a time,
//! yielding to the runtime between steps, all at the decision's instant (one expiry, so the
//! predictions stay prefix-closed). The rest lands within a few polls of the runtime, long
//! before the prompt's next turn; a request with the same long prefix picked meanwhile sees
//! the first steps, and with them the instance.

use std::sync::Arc;
use std::time::Instant;

use kvmesh_kv::WorkerKey;
use prometheus::IntCounter;

use crate::kv::overlap::OverlapSource;
use crate::prepare::PromptBlocks;

/// Blocks recorded at a time: 256 blocks (16k tokens at block size 64) take about 60 µs.
pub(crate) const RECORD_STEP: usize = 256;

/// Records in `overlap` that `worker` holds `prompt`'s blocks from `now` on, counting the
/// pairs pruned to stay under the size bound in `prunes`. Past [`RECORD_STEP`] blocks, the
/// rest is recorded by a task on the current runtime (without one, at once).
pub(crate) fn record_prediction(
    overlap: &Arc<dyn OverlapSource>,
    worker: WorkerKey,
    prompt: &Arc<PromptBlocks>,
    now: Instant,
    prunes: &IntCounter,
) {
    let blocks = prompt.hashes.sequence.len();
    let runtime = (blocks > RECORD_STEP)
        .then(tokio::runtime::Handle::try_current)
        .and_then(Result::ok);
    let first = if runtime.is_some() {
        RECORD_STEP
    } else {
        blocks
    };
    prunes.inc_by(overlap.record_blocks(worker, &prompt.hashes, 0..first, now));
    let Some(runtime) = runtime else {
        return;
    };
    let (overlap, prompt, prunes) = (Arc::clone(overlap), Arc::clone(prompt), prunes.clone());
    runtime.spawn(async move {
        let mut start = first;
        while start < blocks {
            tokio::task::yield_now().await;
            let end = blocks.min(start + RECORD_STEP);
            prunes.inc_by(overlap.record_blocks(worker, &prompt.hashes, start..end, now));
            start = end;
        }
    });
}

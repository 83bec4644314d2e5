//! What routing works on and what it finds: one request as the KV policy sees it
//! ([`KvRequest`]), and the decision ([`Choice`], [`Decision`]).

use std::sync::Arc;

use kvmesh_kv::OverlapScores;

use crate::kv::cost::{Cost, RequestShape};
use crate::prepare::{FallbackReason, PromptBlocks, RouteInput};

/// One request as routing sees it, computed once (the lookup included) and reused when a
/// failed attempt is routed again.
#[derive(Debug)]
pub struct KvRequest {
    /// The prompt's blocks, or why there are none.
    pub(crate) input: RouteInput,
    /// Its size in tokens and blocks.
    pub(crate) shape: RequestShape,
    /// Each instance's cached overlap.
    pub(crate) scores: OverlapScores,
    /// The part of `scores` the engines reported (KV events), without this proxy's
    /// predictions; `None` without live events.
    pub(crate) reported: Option<OverlapScores>,
    /// The session it belongs to (`kv.session_header`), if any.
    pub(crate) session: Option<Arc<str>>,
}

/// The outcome of a routing decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The chosen instance's position in the instances it was chosen from.
    pub index: usize,
    /// The chosen instance's id.
    pub instance_id: u64,
    /// Its cached overlap in blocks.
    pub overlap_blocks: u32,
    /// Its cost with this request.
    pub cost: Cost,
    /// Chosen because the request's session is bound to it.
    pub affinity: bool,
    /// The data-parallel rank of the instance that reported caching the longest prefix of
    /// the request (sent to the engine as `X-data-parallel-rank`); `None`: no rank reported
    /// any, the engine chooses.
    pub dp_rank: Option<u32>,
}

/// A decision as replicas share it: the prompt's blocks went to an instance.
#[derive(Debug, Clone)]
pub struct SharedDecision {
    /// The chosen instance's id.
    pub instance: u64,
    /// The prompt (its block hashes).
    pub prompt: Arc<PromptBlocks>,
}

/// What [`KvRouter::choose`](crate::kv::KvRouter::choose) found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Choice {
    /// An instance.
    Picked(Decision),
    /// Every eligible instance is busy.
    AllBusy,
    /// No instance is eligible (all unhealthy, ejected or already tried).
    NoneEligible,
}

impl KvRequest {
    /// This request, of `session` (`None`: no session).
    pub fn in_session(mut self, session: Option<&str>) -> Self {
        self.session = session.filter(|key| !key.is_empty()).map(Arc::from);
        self
    }

    /// This request as a disaggregated decode leg: the KV of its prompt's full blocks comes
    /// from a prefill engine, each token's pull taking `transfer_ns_per_token`, so a
    /// candidate prefills only the rest (and pulls what it does not cache).
    pub fn with_pulled_kv(mut self, transfer_ns_per_token: u64) -> Self {
        self.shape.pulled_tokens = self.shape.tokens;
        self.shape.transfer_ns_per_token = transfer_ns_per_token;
        self
    }

    /// A request routed by load alone because it carries no prompt.
    pub(crate) fn without_prompt() -> Self {
        Self {
            input: RouteInput::Fallback(FallbackReason::NoPrompt),
            shape: RequestShape::default(),
            scores: OverlapScores::default(),
            reported: None,
            session: None,
        }
    }
}

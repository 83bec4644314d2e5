//! The one trait every policy implements: given the candidates and what was prepared for
//! the request, name an instance (and, for `policy: kv`, book the request's load on it).

use std::fmt;

use crate::candidates::CandidateSet;
use crate::kv::{Booking, KvRequest};
use crate::prepare::RouteInput;

/// What a policy knows about one request besides the candidates, prepared once and reused
/// by every attempt.
#[derive(Debug)]
pub enum PolicyInput {
    /// Nothing: the policy looks at the instances only.
    None,
    /// `policy: kv`: the request's prompt blocks and cached overlaps.
    Kv(KvRequest),
}

impl PolicyInput {
    /// This input as a disaggregated decode leg's (see [`KvRequest::with_pulled_kv`]).
    pub fn pulled(self, transfer_ns_per_token: u64) -> Self {
        match self {
            Self::Kv(request) => Self::Kv(request.with_pulled_kv(transfer_ns_per_token)),
            Self::None => Self::None,
        }
    }

    /// The prompt's tokens, when the request was tokenized.
    #[inline]
    pub fn prompt_tokens(&self) -> Option<usize> {
        match self {
            Self::Kv(request) => match &request.input {
                RouteInput::Tokens(blocks) => Some(blocks.tokens),
                RouteInput::Fallback(_) => None,
            },
            Self::None => None,
        }
    }
}

/// The instance a policy chose for one attempt.
#[derive(Debug)]
pub struct Picked<'a> {
    /// Its index in the candidates.
    pub index: usize,
    /// The load booked for the request (`policy: kv`), released when dropped.
    pub booking: Option<Booking<'a>>,
    /// Why it was chosen: the `x-kvmesh-route` header value (`policy: kv`).
    pub explanation: Option<String>,
    /// The instance's data-parallel rank to send the request to (`policy: kv` with KV
    /// events; `None`: the engine chooses).
    pub dp_rank: Option<u32>,
}

impl Picked<'_> {
    /// Instance `index`, with nothing booked or explained.
    #[inline]
    pub fn index(index: usize) -> Self {
        Self {
            index,
            booking: None,
            explanation: None,
            dp_rank: None,
        }
    }
}

/// Why no instance was picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoPick {
    /// No candidate is eligible (all unavailable or already tried).
    Nothing,
    /// Every eligible candidate is busy.
    Busy,
}

/// A load-balancing policy: picks one eligible instance for a request.
pub trait Policy: Send + Sync + fmt::Debug {
    /// Picks an eligible instance of `candidates` for the request described by `input`.
    fn pick<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        input: &PolicyInput,
    ) -> Result<Picked<'_>, NoPick>;
}

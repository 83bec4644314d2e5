//! KV-aware routing (`policy: kv`): send each request where the least prefill work is left,
//! while keeping decode load even.
//!
//! One request's way through it:
//!
//! 1. **Prepare** ([`crate::prepare`]): the prompt's token ids — chat: template + tokenizer;
//!    completions: the string prompt tokenized, or the token-id prompt as given; a list
//!    prompt routes by its first element — cut into blocks of `kv.block_size` and hashed
//!    ([`kvmesh_kv::BlockHasher`]). Long prompts are tokenized off the reactor
//!    ([`crate::prepare::offload`]). Requests without usable tokens (no tokenizer, embeddings,
//!    responses, multimodal content) are routed by load alone
//!    ([`crate::prepare::FallbackReason`]).
//! 2. **Lookup** ([`overlap`]): how many leading blocks each instance already caches: what
//!    the engines report through the worker-agent's KV events ([`event_feed`], when
//!    `events` is configured and flowing), else *predicted* from the proxy's own decisions
//!    (approximate mode, with a TTL and a size bound).
//! 3. **Score** ([`cost`], [`busy`]): per instance, the load it would have with this request
//!    (active prefill tokens and active blocks from [`load`], plus this request's part),
//!    turned into a predicted time to first token at the instance's learned speed
//!    ([`speed`]) and the model's learned token factor ([`token_cost`]), plus optionally the harm to the streams running there. Busy instances are
//!    left out; when all are, the request waits in the bounded [`admission`] queue or gets
//!    503.
//! 4. **Select** ([`select`]): the instance the request's session is bound to
//!    ([`sessions`]) while it is open, else argmin with a tie-break on in-flight requests
//!    then random, or a softmax draw when `temperature > 0`.
//! 5. **Commit** ([`KvRouter::commit`]): book the load (a [`booking::Booking`] guard
//!    releases prefill at the first response byte and blocks at the end) and record the
//!    prediction (a long prompt's in steps: [`prediction`]). A connect failure drops the
//!    booking and routes again without that instance.
//!
//! With several proxy replicas, one of them decides for all of a model's requests
//! ([`decider`]): the others ask it between lookup and commit, and commit its choice.
//!
//! Every routed response carries `x-kvmesh-route` ([`explain`]); `POST /debug/route` on the
//! admin listener explains a request without forwarding it.
//!
//! The block size is `kv.block_size`, or the first instance record's ([`block_size`]); an
//! instance whose engine runs another is scored by predictions alone and reported.
//!
//! Under live KV events the router checks its index against the engines' own accounting
//! ([`cache_check`]): each answer's `cached_tokens` is compared with the overlap the engine
//! had reported, and an instance that keeps disagreeing is scored approximately and resynced.
//!
//! Once per instance, the proxy compares its own token ids with the engine's `/tokenize`
//! ([`tokenizer_check`]): an engine that tokenizes otherwise is scored approximately too.

mod admission;
mod asks;
mod block_size;
mod booking;
mod busy;
pub(crate) mod cache_check;
mod cost;
mod decider;
mod decision;
mod event_feed;
mod explain;
mod load;
mod overlap;
mod prediction;
mod replicas;
mod router;
mod select;
mod sessions;
mod speed;
mod token_cost;
mod tokenizer_check;

pub use admission::Rejected;
pub use asks::{DecideAsk, QUIET_AFTER_TIMEOUT, REMOTE_BOOKING_TTL, SHARE_WAIT, Steer};
pub use block_size::BlockSizeFit;
pub use booking::Booking;
pub use cache_check::{CacheCheckState, CheckedAnswer};
pub use cost::{Cost, RequestShape};
pub use decision::{Choice, Decision, KvRequest, SharedDecision};
pub use event_feed::EventFeed;
pub(crate) use explain::route_header_noting;
pub use explain::{Explanation, InstanceExplanation};
pub use replicas::{OwnLoads, ReplicaShare, SharedLoad, SharedSpeed};
pub use router::KvRouter;
pub use sessions::SessionBinding;
pub use token_cost::TokenCostSums;
pub use tokenizer_check::{
    Probe, RunningCheck, TokenizerChecks, TokenizerMismatch, TokenizerOutcome, compare, engine_ids,
    probes,
};

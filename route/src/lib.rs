//! kvmesh-route: which instance gets a request.
//!
//! A model's config names a policy; [`Balancer`] holds it. Every policy implements one trait,
//! [`Policy`]: given the model's instances as one pick sees them ([`CandidateSet`]: the
//! proxy's instances through [`Candidate`], less those already tried, [`Excluded`]) and what
//! was prepared for the request ([`PolicyInput`]), it names an instance ([`Picked`]) or says
//! why none ([`NoPick`]). One file per policy under [`policies`]: round robin, random, least
//! request and power of two look at the instances only; `policy: kv` ([`kv::KvRouter`]) looks
//! at the prompt too.
//!
//! A request is routed in four steps, each a call the proxy makes:
//!
//! 1. **Prepare** (`policy: kv` only, when [`Balancer::preparer`] is `Some`): the body's
//!    prompt ([`prepare::PromptKind`]) is rendered, tokenized and hashed into blocks
//!    ([`prepare::Preparer`], off the reactor for long prompts: [`prepare::offload`]), then
//!    looked up in the KV index ([`Balancer::input`]).
//! 2. **Admit**: under `policy: kv`, the request waits in a bounded queue while every
//!    instance is busy ([`Balancer::admit`]).
//! 3. **Pick** ([`Policy::pick`]), once per attempt: `policy: kv` also books the request's
//!    load on the instance ([`kv::Booking`], released when dropped) and explains the choice
//!    (the `x-kvmesh-route` header value).
//! 4. **Release**: the booking's prefill part ends at the first response byte
//!    ([`kv::Booking::prefill_done`]), the rest when the booking drops.
//!
//! The crate knows no HTTP stack: instances reach it through [`Candidate`], routes as
//! [`prepare::PromptKind`], and its metric families ([`metrics::KvFamilies`]) register into
//! the caller's prometheus registry.

#![warn(missing_docs)]

mod balancer;
mod candidates;
mod disaggregation;
pub mod kv;
pub mod metrics;
pub mod policies;
mod policy;
mod pools;
pub mod prepare;

pub use balancer::Balancer;
pub use candidates::{Candidate, CandidateSet, Candidates, Excluded};
pub use disaggregation::prefills_locally;
pub use policy::{NoPick, Picked, Policy, PolicyInput};
pub use pools::{PoolChoice, choose_pool};

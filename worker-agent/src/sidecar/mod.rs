//! The agent as the pod's inbound sidecar (`--inbound-listen`): the address the agent
//! registers, in front of the engine. Every request is forwarded to the local engine
//! unchanged ([`forward`]); decode legs of disaggregated requests are admitted into the
//! pod's KV-transfer budget first ([`pacer`]), so a burst of transfers cannot flood the link
//! the running streams depend on.

pub(crate) mod forward;
pub mod pacer;

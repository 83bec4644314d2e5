//! kvmesh-control: the contract between the worker-agent and the proxy
//! (docs/control-plane.md) and the transports that carry it.
//!
//! - Names: [`Namespace`] builds etcd keys (`/{ns}/instances/{model}/{id}`) and NATS subjects
//!   (`{ns}.kv.{model}`, `{ns}.snapshot.{id}`, `{ns}.load.{model}`), percent-encoding the model.
//! - Payloads: [`InstanceRecord`] (etcd value), [`EventBatch`] of [`kvmesh_kv::KvEvent`]s with
//!   hex hashes ([`WireEvent`] is the wire form), [`SnapshotRequest`] / [`SnapshotReply`] (in parts when large:
//!   [`reply_parts`], [`ReplyAssembler`]),
//!   [`LoadReport`]; all JSON.
//! - Discovery: the [`Registry`] trait (leases, put / delete / list, and a [`Watch`] stream
//!   that survives reconnects: re-list with backoff, emit only differences, keep the last known
//!   records meanwhile), on etcd ([`EtcdRegistry`], on
//!   `etcd-client`, with TLS and auth from [`EtcdSettings`]) or in
//!   process ([`InProcessRegistry`]).
//! - Events: the [`EventBus`] trait (publish, subscribe, request-reply, serve, and a
//!   [`ConnectionState`] signal whose epoch grows on every reconnect), on NATS ([`NatsBus`], on
//!   `async-nats`, with TLS and auth from [`NatsSettings`]) or in process ([`InProcessBus`]).
//! - `transports` (default cargo feature): the etcd and NATS clients. Without it the crate is
//!   the contract and the in-process stand-ins, which is how the fuzz targets build it (fuzz/,
//!   docs/fuzzing.md).
//! - `testing` (cargo feature): launchers of real etcd and nats-server processes.

mod backoff;
mod bus;
mod error;
mod events;
mod ids;
mod instance;
mod load;
mod namespace;
mod registry;
mod replica;
mod reply_parts;
mod resync;
mod security;
#[cfg(feature = "testing")]
pub mod testing;

pub use bus::{
    ConnectionState, EventBus, InProcessBus, Message, SUBSCRIPTION_BUFFER, Subscription,
    subject_matches, validate_subject,
};
#[cfg(feature = "transports")]
pub use bus::{DurableStream, NatsBus, NatsSettings};
pub use error::ControlError;
pub use events::{EventBatch, RankedEvent, WireBlock, WireEvent, WireParent, event_blocks};
pub use ids::{HexU64, InstanceId};
pub use instance::{InstanceRecord, InstanceRole, InstanceState};
pub use load::LoadReport;
pub use namespace::{
    DEFAULT_NAMESPACE, Namespace, decode_model, encode_model_for_key, encode_model_for_subject,
};
#[cfg(feature = "transports")]
pub use registry::{EtcdRegistry, EtcdSettings};
pub use registry::{InProcessRegistry, LeaseId, Listing, Registry, Watch, WatchEvent};
pub use replica::{
    DecideAnswer, DecideRequest, DecisionShare, InstanceLoadShare, LoadShare, SessionShare,
    TokenCostShare,
};
pub use reply_parts::{ReplyAssembler, ReplyPart, reply_parts};
pub use resync::{SnapshotReply, SnapshotRequest};
pub use security::{EtcdAuth, NatsAuth, TlsFiles, read_secret};

//! What talks to engines: instances and their health, model pools and the registry of
//! models, where instances come from, and the engine clients (routing itself is the
//! `kvmesh-route` crate).

pub(crate) mod adapters;
pub(crate) mod clock;
pub(crate) mod discovery;
pub(crate) mod health;
pub(crate) mod instance;
pub(crate) mod outlier;
pub(crate) mod pool;
pub(crate) mod pool_builder;
pub(crate) mod protocol;
pub(crate) mod registry;
pub(crate) mod upstream;
pub(crate) mod upstream_session;

//! The Prometheus metric families (`kvmesh_*`), and the label sets they count by that no
//! lower layer defines: upstream failure kinds, the gRPC inference RPCs, the endpoint
//! picker's families, token timings.

pub(crate) mod epp;
pub(crate) mod failure;
pub(crate) mod families;
pub(crate) mod rpc;
pub(crate) mod token_timing;

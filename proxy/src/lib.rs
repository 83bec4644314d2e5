//! kvmesh-proxy

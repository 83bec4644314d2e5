//! kvmesh-config

//! kvmesh-kv

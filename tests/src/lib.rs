//! kvmesh-e2e

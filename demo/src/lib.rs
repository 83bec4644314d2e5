//! kvmesh-demo

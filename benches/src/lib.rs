//! kvmesh-bench

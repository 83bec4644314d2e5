//! kvmesh-engine-sim

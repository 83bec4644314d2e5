//! Harness for kvmesh's end-to-end tests.
//!
//! The tests start the project's real binaries (`kvmesh-engine-sim`,
//! `kvmesh-agent`, `kvmesh-proxy`, and `etcd` / `nats-server`) on loopback and
//! drive them with real HTTP clients. Every
//! server binary announces readiness on stdout (`LISTENING <name> <addr>` per
//! listener, then `READY`), so the harness never sleeps to wait for a port.

pub mod certs;
pub mod client;
pub mod cluster;
pub mod control_plane;
pub mod grpc;
pub mod process;
pub mod relay;
pub mod scratch;
pub mod sse;

pub use client::{HttpClient, Response, StreamingResponse};
pub use process::Spawned;
pub use scratch::ScratchDir;

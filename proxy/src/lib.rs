//! kvmesh-proxy: the edge proxy in front of OpenAI-compatible engines.
//!
//! Built on pingora-core: our own tokio accept loop (TCP_NODELAY on every
//! socket, port 0, graceful drain) hands each connection to pingora's HTTP/1.1
//! and h2c server sessions; engines are reached through pingora's pooled
//! connector. Each request's body is read whole (its `model` picks the pool),
//! forwarded byte-identical to an instance chosen by the model's policy, and
//! the response is relayed chunk by chunk. Under `policy: kv` the prompt is
//! tokenized and the instance chosen by cached-prefix overlap and load (see the
//! `kvmesh-route` crate); responses then carry `x-kvmesh-route`, and the admin
//! listener explains decisions at `POST /debug/route`. With `grpc.address` set,
//! a tonic listener serves the KServe v2 gRPC API over the same state and the
//! same forwarding path (the `grpc` module). With `epp.address` set, it is also the
//! endpoint picker of a Gateway API Inference Extension pool (the `epp` module): Envoy asks
//! it over `ext_proc` where each request goes.
//!
//! ```no_run
//! # async fn demo(config: kvmesh_config::Config) -> Result<(), Box<dyn std::error::Error>> {
//! let proxy = kvmesh_proxy::Proxy::bind(config).await?;
//! proxy.announce(&mut std::io::stdout())?;
//! println!("READY");
//! proxy.run(async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(())
//! # }
//! ```

// The layers, each a directory, lowest first: a layer imports only from its own directory
// and those before it (`runtime/layering.rs` checks it; docs/architecture.md draws them).

// The API's shapes.
mod openai;
// Policy at the edge.
mod edge;
// The Prometheus families.
mod metrics;
// What talks to engines.
mod engines;
// The per-config state and the tasks that walk it.
mod state;
// The spine: one proxied request, phase by phase.
mod request;
// What talks to clients.
mod frontend;
// Building and running it all.
mod runtime;

#[doc(hidden)]
pub use runtime::bench_support;

pub use edge::auth::sha256_hex;
pub use edge::error::ProxyError;
pub use edge::tls::{TlsError, check_config_files};
pub use runtime::control_plane::ControlPlane;
pub use runtime::reload::{ReloadError, ReloadHandle};
pub use runtime::server::{ADMIN_LISTENER, BoundListener, Proxy, serve_until};

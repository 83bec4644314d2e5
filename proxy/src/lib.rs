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

mod accept;
mod adapters;
mod admin_app;
mod api_error;
mod auth;
#[doc(hidden)]
pub mod bench_support;
mod clock;
mod control_plane;
mod data_app;
mod discovery;
mod edge_metrics;
mod engine_protocol;
mod epp;
mod error;
mod failure;
mod grpc;
mod h1;
mod headers;
mod health;
mod health_check;
mod instance;
mod kv_sweeper;
mod layering;
mod limits;
mod metrics;
mod openapi;
mod outlier;
mod pool;
mod pool_builder;
mod registry;
mod reload;
mod request;
mod request_body;
mod request_fields;
mod request_id;
mod respond;
mod retry;
mod route;
mod server;
mod sse;
mod state;
mod tls;
mod token_timing;
mod tokenizer_check;
mod upstream;
mod upstream_session;
mod usage;

pub use auth::sha256_hex;
pub use control_plane::ControlPlane;
pub use error::ProxyError;
pub use reload::{ReloadError, ReloadHandle};
pub use server::{ADMIN_LISTENER, BoundListener, Proxy, serve_until};
pub use tls::{TlsError, check_config_files};

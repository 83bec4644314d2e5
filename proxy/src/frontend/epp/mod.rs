//! kvmesh as the endpoint picker (EPP) of a Gateway API Inference Extension
//! `InferencePool` (`epp.address`): Envoy-based gateways (Istio, Envoy Gateway, kgateway,
//! GKE's, Envoy AI Gateway) ask it over Envoy's `ext_proc` protocol which pod serves each
//! request, and send the request there themselves.
//!
//! It shares the one [`crate::state::shared::State`] with the HTTP and KServe listeners: models,
//! policies, the KV index and its events, bookings and metrics, so `POST /debug/route`
//! explains its picks too. The protocol (GAIE `004-endpoint-picker-protocol`, v1):
//!
//! - the pick goes back as the header and the dynamic metadata
//!   `envoy.lb` → `x-gateway-destination-endpoint` (`ip:port`, then `epp.fallbacks` more,
//!   comma-separated), the request body untouched ([`exchange`]);
//! - the subset hint (`envoy.lb.subset_hint` → `x-gateway-destination-endpoint-subset`)
//!   limits the choice; nothing eligible in it is a 503 ([`decide`]);
//! - errors are immediate responses: 400/404/413 for bad requests, 429 when shedding load
//!   (every instance busy, the model's slots taken), 503 with no endpoint;
//! - the served endpoint the gateway reports (`envoy.lb` →
//!   `x-gateway-destination-endpoint-served`) gets the request's load ([`follow`]);
//! - `grpc.health.v1`: `liveness`, `readiness` and the ext_proc service ([`server`]).

mod decide;
mod exchange;
mod follow;
mod request_read;
mod server;
mod settings;
mod wire;

pub(crate) use server::EppListener;

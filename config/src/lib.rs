//! kvmesh-config: the proxy's YAML configuration.
//!
//! One file, every field defaulted and documented. [`Config::from_yaml_str`] and
//! [`Config::load`] parse and validate it; errors name the source, line, column
//! and field, e.g. `config.yaml:12:5: models[0].backends[1].url: invalid URL "x"`.
//! Configs built in code are checked with [`Config::validate`].

mod auth;
mod backend_url;
mod concurrency;
mod config;
mod control_security;
mod disaggregation;
mod discovery;
mod duration;
mod engine_routes;
mod epp;
mod error;
mod events;
mod field_path;
mod grpc;
mod health_check;
mod kv_routing;
mod limits;
mod listener;
mod model;
mod outlier;
mod reload;
mod retry;
mod shutdown;
mod source_map;
mod telemetry;
mod tls;
mod upstream;
mod validate;
mod validate_control_plane;
mod validate_kv;
mod violation;

pub use auth::{ApiKeyConfig, AuthConfig};
pub use backend_url::{BackendUrl, BackendUrlError};
pub use concurrency::ConcurrencyConfig;
pub use config::Config;
pub use control_security::{ControlTlsConfig, EtcdAuthConfig, NatsAuthConfig};
pub use disaggregation::{
    DisaggregationConfig, DisaggregationMode, DisaggregationProtocol, PrefillFailure,
};
pub use discovery::{DEFAULT_NAMESPACE, DefaultModelConfig, DiscoveryConfig, DiscoveryKind};
pub use duration::{DurationError, format_duration, parse_duration};
pub use engine_routes::{
    ENGINE_ROUTES, EngineAccess, EngineRouteSpec, EngineRoutesConfig, KVMESH_ROUTES, engine_route,
};
pub use epp::{EPP_LISTENER, EppConfig, MAX_EPP_FALLBACKS};
pub use error::{ConfigError, Invalid, TextPosition};
pub use events::{EventsConfig, EventsKind, JetStreamConfig};
pub use field_path::{FieldPath, Segment};
pub use grpc::{GRPC_LISTENER, GrpcConfig, MAX_GRPC_MESSAGE_BYTES};
pub use health_check::HealthCheckConfig;
pub use kv_routing::{
    FALLBACK_BLOCK_SIZE, KvCacheCheckConfig, KvQueueConfig, KvRoutingConfig, KvTierWeights,
    KvTokenizerCheckConfig, MAX_APPROX_TTL,
};
pub use limits::LimitsConfig;
pub use listener::{AdminConfig, ListenerConfig};
pub use model::{
    BackendConfig, DEFAULT_MIGRATION_LIMIT, ModelConfig, PolicyKind, PoolConfig, Protocol, Role,
};
pub use outlier::OutlierDetectionConfig;
pub use reload::ReloadConfig;
pub use retry::RetryConfig;
pub use shutdown::ShutdownConfig;
pub use telemetry::TelemetryConfig;
pub use tls::{ListenerTlsConfig, UpstreamTlsConfig};
pub use upstream::UpstreamConfig;

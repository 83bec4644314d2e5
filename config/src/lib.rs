//! kvmesh-config: the proxy's YAML configuration.
//!
//! One file, every field defaulted and documented. [`Config::from_yaml_str`] and
//! [`Config::load`] parse and validate it; errors name the source, line, column
//! and field, e.g. `config.yaml:12:5: models[0].backends[1].url: invalid URL "x"`.
//! Configs built in code are checked with [`Config::validate`].

mod backend_url;
mod config;
mod duration;
mod error;
mod field_path;
mod health_check;
mod kv_routing;
mod limits;
mod listener;
mod model;
mod outlier;
mod shutdown;
mod source_map;
mod upstream;
mod validate;

pub use backend_url::{BackendUrl, BackendUrlError};
pub use config::Config;
pub use duration::{DurationError, format_duration, parse_duration};
pub use error::{ConfigError, Invalid, TextPosition};
pub use field_path::{FieldPath, Segment};
pub use health_check::HealthCheckConfig;
pub use kv_routing::{KvQueueConfig, KvRoutingConfig, MAX_APPROX_TTL};
pub use limits::LimitsConfig;
pub use listener::{AdminConfig, ListenerConfig};
pub use model::{BackendConfig, ModelConfig, PolicyKind, Protocol};
pub use outlier::OutlierDetectionConfig;
pub use shutdown::ShutdownConfig;
pub use upstream::UpstreamConfig;

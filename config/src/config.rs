//! The root of the config file and its entry points.

use std::path::Path;

use serde::Deserialize;
use serde_saphyr::MessageFormatter;

use crate::source_map::{SourceMap, position};
use crate::validate::validate;
use crate::violation::Violation;
use crate::{
    AdminConfig, AuthConfig, ConfigError, DiscoveryConfig, EngineRoutesConfig, EppConfig,
    EventsConfig, FieldPath, GrpcConfig, HealthCheckConfig, Invalid, LimitsConfig, ListenerConfig,
    ModelConfig, OutlierDetectionConfig, ReloadConfig, RetryConfig, Segment, ShutdownConfig,
    TelemetryConfig, UpstreamConfig,
};

/// The whole proxy configuration (one YAML file). Every section is optional and
/// defaults as documented on its fields; only `models` must be given.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Data listeners (default: one, `main` on 127.0.0.1:8080).
    pub listeners: Vec<ListenerConfig>,
    /// The admin listener (default 127.0.0.1:9090).
    pub admin: AdminConfig,
    /// The KServe v2 gRPC listener (default: none).
    pub grpc: GrpcConfig,
    /// The endpoint picker listener for Envoy-based gateways (default: none).
    pub epp: EppConfig,
    /// Served models and their backends (at least one).
    pub models: Vec<ModelConfig>,
    /// The engines' own routes forwarded as they are (`/tokenize`, `/v1/rerank`, …).
    pub engine_routes: EngineRoutesConfig,
    /// Body size limit and timeouts.
    pub limits: LimitsConfig,
    /// Retries of failed engine answers and their budget.
    pub retry: RetryConfig,
    /// Active health checks.
    pub health_check: HealthCheckConfig,
    /// Passive ejection of failing backends.
    pub outlier_detection: OutlierDetectionConfig,
    /// Upstream connection pool.
    pub upstream: UpstreamConfig,
    /// Graceful shutdown.
    pub shutdown: ShutdownConfig,
    /// API keys and their limits (none: no authentication).
    pub auth: AuthConfig,
    /// Watching the config file and certificates for changes.
    pub reload: ReloadConfig,
    /// Where instances come from besides `backends` (default: static only).
    pub discovery: DiscoveryConfig,
    /// Where KV events and load reports come from (default: none).
    pub events: EventsConfig,
    /// Tracing: OpenTelemetry spans over OTLP/gRPC (default: off).
    pub telemetry: TelemetryConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listeners: vec![ListenerConfig::default()],
            admin: AdminConfig::default(),
            grpc: GrpcConfig::default(),
            epp: EppConfig::default(),
            models: Vec::new(),
            engine_routes: EngineRoutesConfig::default(),
            limits: LimitsConfig::default(),
            retry: RetryConfig::default(),
            health_check: HealthCheckConfig::default(),
            outlier_detection: OutlierDetectionConfig::default(),
            upstream: UpstreamConfig::default(),
            shutdown: ShutdownConfig::default(),
            auth: AuthConfig::default(),
            reload: ReloadConfig::default(),
            discovery: DiscoveryConfig::default(),
            events: EventsConfig::default(),
            telemetry: TelemetryConfig::default(),
        }
    }
}

/// Name used in errors for configs that did not come from a file.
const IN_CODE_SOURCE: &str = "config";

impl Config {
    /// Parses and validates YAML text; `source_name` (usually the file path)
    /// prefixes error messages.
    pub fn from_yaml_str(text: &str, source_name: &str) -> Result<Self, ConfigError> {
        let config = match serde_saphyr::from_str::<Config>(text) {
            Ok(config) => config,
            Err(error) => return Err(parse_error(&error, text, source_name)),
        };
        if let Err(violation) = validate(&config) {
            let map = SourceMap::parse(text);
            let position = map.and_then(|map| map.position_of(&violation.path));
            return Err(violation.into_error(source_name, position));
        }
        Ok(config)
    }

    /// Reads, parses and validates the file at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml_str(&text, &path.display().to_string())
    }

    /// Validates a config built in code (errors name the field, not a line).
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate(self).map_err(|violation| violation.into_error(IN_CODE_SOURCE, None))
    }
}

impl Violation {
    fn into_error(self, source_name: &str, position: Option<crate::TextPosition>) -> ConfigError {
        ConfigError::Invalid(Invalid {
            source_name: source_name.to_string(),
            position,
            field: Some(self.path),
            message: self.message,
        })
    }
}

fn parse_error(error: &serde_saphyr::Error, text: &str, source_name: &str) -> ConfigError {
    let error = error.without_snippet();
    let message: String = serde_saphyr::DefaultMessageFormatter
        .format_message(error)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let position = error.location().as_ref().and_then(position);
    let field = position
        .and_then(|position| SourceMap::parse(text)?.path_at(position))
        .map(|path| with_unknown_field(path, &message));
    ConfigError::Invalid(Invalid {
        source_name: source_name.to_string(),
        position,
        field,
        message,
    })
}

/// An unknown-field error points at the key; when that key is also the first
/// of its mapping the position resolves to the mapping, so name the key.
fn with_unknown_field(path: FieldPath, message: &str) -> FieldPath {
    let name = message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(name, _)| name);
    match name {
        Some(name) if path.segments().last() != Some(&Segment::Key(name.to_string())) => {
            path.key(name)
        }
        _ => path,
    }
}

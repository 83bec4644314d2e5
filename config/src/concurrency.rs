//! A model's concurrency limit and the bounded queue in front of it.

use std::time::Duration;

use serde::Deserialize;

use crate::FieldPath;
use crate::violation::{Checked, fail, positive};

/// How many requests of one model are forwarded at once; the rest wait in a
/// bounded queue (first come, first served) or are answered 503.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConcurrencyConfig {
    /// Requests forwarded to the model's engines at once; `null` (the default): unlimited.
    pub max_in_flight: Option<u32>,
    /// Requests that may wait for a free slot; when the queue is full, 503 at once.
    pub queue_size: u32,
    /// Longest wait in the queue, then 503.
    #[serde(deserialize_with = "crate::duration::deserialize")]
    pub queue_timeout: Duration,
}

impl Default for ConcurrencyConfig {
    fn default() -> Self {
        Self {
            max_in_flight: None,
            queue_size: 128,
            queue_timeout: Duration::from_secs(10),
        }
    }
}

/// Checks `models[i].concurrency`; `path` points at it.
pub(crate) fn check_concurrency(concurrency: &ConcurrencyConfig, path: &FieldPath) -> Checked {
    if concurrency.max_in_flight == Some(0) {
        return fail(
            path.key("max_in_flight"),
            "must be at least 1 (or null: unlimited)",
        );
    }
    positive(concurrency.queue_timeout, path.key("queue_timeout"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{Config, ConfigError};

    const MODEL: &str = "models:\n  - name: m\n    backends:\n      - url: http://127.0.0.1:1\n";

    #[test]
    fn parses_and_rejects_a_zero_limit() {
        let text = format!(
            "{MODEL}    concurrency:\n      max_in_flight: 8\n      queue_size: 2\n      queue_timeout: 250ms\n"
        );
        let config = Config::from_yaml_str(&text, "c.yaml").unwrap();
        let concurrency = &config.models[0].concurrency;
        assert_eq!(concurrency.max_in_flight, Some(8));
        assert_eq!(concurrency.queue_size, 2);
        assert_eq!(concurrency.queue_timeout, Duration::from_millis(250));
        let zero = format!("{MODEL}    concurrency:\n      max_in_flight: 0\n");
        match Config::from_yaml_str(&zero, "c.yaml") {
            Err(ConfigError::Invalid(invalid)) => assert_eq!(
                invalid.to_string(),
                "c.yaml:6:22: models[0].concurrency.max_in_flight: must be at least 1 (or null: unlimited)"
            ),
            other => panic!("{other:?}"),
        }
    }
}

//! Disaggregated prefill/decode: a model's prefill legs on one instance, its decode on another.

use serde::Deserialize;

use crate::violation::{Checked, fail};
use crate::{FieldPath, ModelConfig, PolicyKind};

/// When a request's prefill runs on a prefill instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisaggregationMode {
    /// Every chat and completions request (Dynamo's `enforce_disagg`).
    Enforce,
    /// Only when the part of the prompt the chosen decode instance does not cache is at
    /// least `min_remote_prefill_tokens` long (Dynamo's conditional disaggregation,
    /// `isl_bounding`); shorter ones prefill on the decode instance itself.
    #[default]
    Conditional,
}

/// What a request does when its prefill leg fails (no prefill instance, a connect error, an
/// engine error, an answer without `kv_transfer_params`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillFailure {
    /// The decode instance serves it whole (prefills itself).
    #[default]
    Aggregated,
    /// 503 (the prefill leg's failure named).
    Fail,
}

/// The engines' disaggregation protocol: how the legs are built and joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisaggregationProtocol {
    /// vLLM's: the prefill leg asks for `kv_transfer_params`, which the decode leg carries
    /// (NixlConnector and the other KV connectors).
    #[default]
    Vllm,
    /// SGLang's: both legs at once, each the client's request with the prefill instance's
    /// `bootstrap_host` and `bootstrap_port` and one `bootstrap_room` (as sglang-router's PD
    /// mode sends them).
    Sglang,
}

/// `models[].disaggregation`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggregationConfig {
    /// When to prefill remotely.
    pub mode: DisaggregationMode,
    /// The engines' protocol for the two legs.
    pub protocol: DisaggregationProtocol,
    /// `conditional`: the uncached prompt tokens (on the chosen decode instance) from which
    /// the prefill runs remotely.
    pub min_remote_prefill_tokens: u64,
    /// What a failed prefill leg does.
    pub on_prefill_failure: PrefillFailure,
    /// KV bytes of one token of the served model (`layers × 2 × kv_heads × head_dim ×
    /// dtype bytes`; Qwen3-8B in bf16: 147,456), for the pull's cost in the decode choice.
    pub kv_bytes_per_token: u64,
    /// Bandwidth of a decode instance's inbound KV link, GB/s (12.5: a 100 Gb/s NIC).
    pub link_gbps: f64,
}

impl DisaggregationConfig {
    /// Nanoseconds one token's KV takes over the link.
    pub fn transfer_ns_per_token(&self) -> u64 {
        (self.kv_bytes_per_token as f64 / self.link_gbps).round() as u64
    }
}

impl Default for DisaggregationConfig {
    fn default() -> Self {
        Self {
            mode: DisaggregationMode::Conditional,
            protocol: DisaggregationProtocol::Vllm,
            min_remote_prefill_tokens: 512,
            on_prefill_failure: PrefillFailure::Aggregated,
            kv_bytes_per_token: 147_456,
            link_gbps: 64.0,
        }
    }
}

/// Checks `model.pools` and the backends' `pool`; `path` points at the model.
pub(crate) fn check_pools(model: &ModelConfig, path: &FieldPath) -> Checked {
    let mut names = std::collections::HashSet::new();
    for (i, pool) in model.pools.iter().enumerate() {
        let at = path.key("pools").index(i);
        if pool.name.is_empty() || !names.insert(pool.name.as_str()) {
            return fail(
                at.key("name"),
                format!("a unique, non-empty name (got {:?})", pool.name),
            );
        }
        for (field, target) in [
            ("ttft_target_ms", pool.ttft_target_ms),
            ("itl_target_ms", pool.itl_target_ms),
        ] {
            if target.is_some_and(|ms| !(ms.is_finite() && ms > 0.0)) {
                return fail(at.key(field), "must be a positive number of ms");
            }
        }
        if pool.max_input_tokens == Some(0) {
            return fail(at.key("max_input_tokens"), "must be at least 1");
        }
    }
    if !model.pools.is_empty() && model.policy != PolicyKind::Kv {
        return fail(
            path.key("pools"),
            "needs policy: kv (pools are chosen by the prompt's tokens)",
        );
    }
    for (j, backend) in model.backends.iter().enumerate() {
        if let Some(pool) = &backend.pool
            && !names.contains(pool.as_str())
        {
            return fail(
                path.key("backends").index(j).key("pool"),
                format!("names no pool of the model ({pool:?})"),
            );
        }
    }
    Ok(())
}

/// Checks `model.disaggregation`; `path` points at the model.
pub(crate) fn check_disaggregation(model: &ModelConfig, path: &FieldPath) -> Checked {
    let Some(disaggregation) = &model.disaggregation else {
        let split = model
            .backends
            .iter()
            .position(|b| b.role != crate::Role::Both);
        if let Some(i) = split {
            return fail(
                path.key("backends").index(i).key("role"),
                "a role needs the model's disaggregation section",
            );
        }
        return Ok(());
    };
    let path = path.key("disaggregation");
    if model.policy != PolicyKind::Kv {
        return fail(
            path,
            "needs policy: kv (the prefill instance is chosen by its KV index)",
        );
    }
    if disaggregation.kv_bytes_per_token == 0 {
        return fail(path.key("kv_bytes_per_token"), "must be at least 1");
    }
    if !(disaggregation.link_gbps.is_finite() && disaggregation.link_gbps > 0.0) {
        return fail(path.key("link_gbps"), "must be a positive number of GB/s");
    }
    if disaggregation.mode == DisaggregationMode::Conditional
        && disaggregation.min_remote_prefill_tokens == 0
    {
        return fail(
            path.key("min_remote_prefill_tokens"),
            "must be at least 1 (use mode: enforce to always prefill remotely)",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{Config, Role};

    use super::*;

    fn parse(model_extra: &str, backends: &str) -> Result<Config, crate::ConfigError> {
        Config::from_yaml_str(
            &format!(
                "models:\n  - name: m\n    policy: kv\n{model_extra}    backends:\n{backends}"
            ),
            "test.yaml",
        )
    }

    const SPLIT: &str = "      - url: http://127.0.0.1:8000\n        role: prefill\n      - url: http://127.0.0.1:8001\n        role: decode\n";

    #[test]
    fn off_by_default_and_conditional_when_on() {
        let config = parse("", "      - url: http://127.0.0.1:8000\n").unwrap();
        assert_eq!(config.models[0].disaggregation, None);
        assert_eq!(config.models[0].backends[0].role, Role::Both);
        let config = parse("    disaggregation: {}\n", SPLIT).unwrap();
        let on = config.models[0].disaggregation.clone().unwrap();
        assert_eq!(on, DisaggregationConfig::default());
        assert_eq!(on.transfer_ns_per_token(), 2304);
        assert_eq!(on.mode, DisaggregationMode::Conditional);
        assert_eq!(config.models[0].backends[0].role, Role::Prefill);
        let config = parse(
            "    disaggregation:\n      mode: enforce\n      on_prefill_failure: fail\n",
            SPLIT,
        )
        .unwrap();
        let on = config.models[0].disaggregation.clone().unwrap();
        assert_eq!(
            (on.mode, on.on_prefill_failure),
            (DisaggregationMode::Enforce, PrefillFailure::Fail)
        );
        // A 100 Gb/s NIC: 12.5 GB/s.
        let config = parse("    disaggregation:\n      link_gbps: 12.5\n", SPLIT).unwrap();
        let on = config.models[0].disaggregation.clone().unwrap();
        assert_eq!(on.transfer_ns_per_token(), 11_796);
        for bad in ["0", "-1", ".inf"] {
            let error = parse(
                &format!("    disaggregation:\n      link_gbps: {bad}\n"),
                SPLIT,
            )
            .unwrap_err()
            .to_string();
            assert!(error.contains("disaggregation.link_gbps"), "{bad}: {error}");
        }
    }

    #[test]
    fn pools_parse_and_name_their_backends() {
        let backends = "      - url: http://127.0.0.1:8000\n        pool: short\n      - url: http://127.0.0.1:8001\n        pool: long\n";
        let config = parse(
            "    pools:\n      - name: short\n        max_input_tokens: 2048\n        ttft_target_ms: 200\n      - name: long\n",
            backends,
        )
        .unwrap();
        let pools = &config.models[0].pools;
        assert_eq!(pools.len(), 2);
        assert_eq!(
            (pools[0].max_input_tokens, pools[0].ttft_target_ms),
            (Some(2048), Some(200.0))
        );
        assert_eq!(pools[1].max_input_tokens, None);
        assert_eq!(config.models[0].backends[1].pool.as_deref(), Some("long"));
        for (pools, backends, field) in [
            (
                "    pools:\n      - name: a\n      - name: a\n",
                "      - url: http://127.0.0.1:8000\n",
                "pools[1].name",
            ),
            (
                "    pools:\n      - name: a\n        max_input_tokens: 0\n",
                "      - url: http://127.0.0.1:8000\n",
                "pools[0].max_input_tokens",
            ),
            (
                "    pools:\n      - name: a\n        ttft_target_ms: -1\n",
                "      - url: http://127.0.0.1:8000\n",
                "pools[0].ttft_target_ms",
            ),
            (
                "    pools:\n      - name: a\n        itl_target_ms: .nan\n",
                "      - url: http://127.0.0.1:8000\n",
                "pools[0].itl_target_ms",
            ),
            (
                "    pools:\n      - name: a\n",
                "      - url: http://127.0.0.1:8000\n        pool: b\n",
                "backends[0].pool",
            ),
        ] {
            let error = parse(pools, backends).unwrap_err().to_string();
            assert!(error.contains(field), "{field}: {error}");
        }
        let error = Config::from_yaml_str(
            "models:\n  - name: m\n    pools:\n      - name: a\n    backends:\n      - url: http://127.0.0.1:8000\n",
            "test.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("pools") && error.contains("policy: kv"),
            "{error}"
        );
    }

    #[test]
    fn rejects_what_cannot_work_with_the_field() {
        let error = parse("", SPLIT).unwrap_err().to_string();
        assert!(error.contains("models[0].backends[0].role"), "{error}");
        let error = Config::from_yaml_str(
            &format!("models:\n  - name: m\n    disaggregation: {{}}\n    backends:\n{SPLIT}"),
            "test.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("models[0].disaggregation") && error.contains("policy: kv"),
            "{error}"
        );
        let error = parse(
            "    disaggregation:\n      min_remote_prefill_tokens: 0\n",
            SPLIT,
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("min_remote_prefill_tokens"), "{error}");
        let error = parse(
            "",
            "      - url: http://127.0.0.1:8000\n        role: sideways\n",
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("role"), "{error}");
    }
}

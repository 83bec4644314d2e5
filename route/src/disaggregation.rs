//! The prefill decision of a disaggregated model (`disaggregation`): whether a request
//! prefills on a prefill instance (remotely) or on the decode instance it goes to (locally).
//! The front ends' request paths ask this one decision.

use kvmesh_config::{DisaggregationConfig, DisaggregationMode};

use crate::balancer::Balancer;
use crate::candidates::CandidateSet;
use crate::policy::PolicyInput;

/// Why a request of a model disaggregated as `config` prefills on its decode instance
/// (`None`: on a prefill instance). `generates`: the request is a chat or completions one
/// (others, named `route`, always stay local). Under `conditional`, the decode instance
/// `balancer` would choose among `decoders` for `input` is asked how much of the prompt it
/// would prefill: less than `min_remote_prefill_tokens` stays local.
pub fn prefills_locally<S: CandidateSet + ?Sized>(
    balancer: &Balancer,
    config: &DisaggregationConfig,
    (generates, route): (bool, &str),
    decoders: &S,
    input: &PolicyInput,
) -> Option<String> {
    if !generates {
        return Some(format!("route {route}"));
    }
    if config.mode == DisaggregationMode::Enforce {
        return None;
    }
    if input.prompt_tokens().is_none() {
        return Some(match input {
            PolicyInput::None => "no prompt".to_string(),
            PolicyInput::Kv(_) => {
                "prompt not tokenized: no tokenizer, or content it cannot read".to_string()
            }
        });
    }
    let uncached = balancer.predict(decoders, input)?.new_prefill_tokens();
    (uncached < config.min_remote_prefill_tokens).then(|| {
        format!(
            "{uncached} uncached tokens < min_remote_prefill_tokens {}",
            config.min_remote_prefill_tokens
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_support::Fake;

    #[test]
    fn other_routes_and_unread_prompts_stay_local_and_enforce_goes_remote() {
        let balancer = Balancer::load_only(kvmesh_config::PolicyKind::RoundRobin).unwrap();
        let decoders = Fake(vec![(true, 0)]);
        let conditional = DisaggregationConfig {
            mode: DisaggregationMode::Conditional,
            ..DisaggregationConfig::default()
        };
        let enforce = DisaggregationConfig {
            mode: DisaggregationMode::Enforce,
            ..DisaggregationConfig::default()
        };
        let decide = |config, generates| {
            prefills_locally(
                &balancer,
                config,
                (generates, "embeddings"),
                &decoders,
                &PolicyInput::None,
            )
        };
        assert_eq!(decide(&enforce, false).as_deref(), Some("route embeddings"));
        assert_eq!(decide(&enforce, true), None);
        assert_eq!(decide(&conditional, true).as_deref(), Some("no prompt"));
    }
}

//! The engines' own wire protocols where kvmesh speaks more than the OpenAI API: how a
//! disaggregated request's legs are built and joined. The spine asks the model's protocol
//! (`disaggregation.protocol`); it spells no engine field names.
//!
//! Two protocols: vLLM's (NixlConnector and its peers), whose legs run one after the other
//! ([`Legs::Sequential`]), and SGLang's, whose legs are sent at once and meet in a bootstrap
//! room ([`Legs::Concurrent`]).

pub(crate) mod sglang;
pub(crate) mod vllm;

use kvmesh_config::DisaggregationProtocol;

/// How a protocol runs a disaggregated request's two legs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Legs {
    /// The prefill leg first ([`vllm::prefill_leg`]); its answer makes the decode leg
    /// ([`vllm::decode_leg`]).
    Sequential,
    /// Both legs at once, the same body ([`sglang::leg`]); the prefill leg's answer is
    /// only judged.
    Concurrent,
}

/// How `protocol`'s legs run.
pub(crate) fn legs(protocol: DisaggregationProtocol) -> Legs {
    match protocol {
        DisaggregationProtocol::Vllm => Legs::Sequential,
        DisaggregationProtocol::Sglang => Legs::Concurrent,
    }
}

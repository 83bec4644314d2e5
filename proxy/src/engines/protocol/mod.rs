//! The engines' own wire protocols where kvmesh speaks more than the OpenAI API: how a
//! disaggregated request's legs are built and joined. The spine asks the model's protocol
//! (`disaggregation.protocol`); it spells no engine field names.
//!
//! Today one protocol: vLLM's (NixlConnector and its peers), whose legs run one after the
//! other ([`Legs::Sequential`]). A protocol whose legs are sent at once (SGLang's
//! bootstrap rooms) adds a variant here.

pub(crate) mod vllm;

use bytes::Bytes;
use kvmesh_config::DisaggregationProtocol;
use serde_json::{Map, Value};

/// How a protocol runs a disaggregated request's two legs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Legs {
    /// The prefill leg first; its answer makes the decode leg.
    Sequential,
}

/// How `protocol`'s legs run.
pub(crate) fn legs(protocol: DisaggregationProtocol) -> Legs {
    match protocol {
        DisaggregationProtocol::Vllm => Legs::Sequential,
    }
}

/// The prefill leg's body in `protocol` for the client's `request` (a JSON object).
pub(crate) fn prefill_leg(
    protocol: DisaggregationProtocol,
    request: &Map<String, Value>,
) -> Result<Bytes, String> {
    match protocol {
        DisaggregationProtocol::Vllm => vllm::prefill_leg(request),
    }
}

/// The decode leg's body in `protocol`: the client's `request` joined with what the prefill
/// engine answered (`answer`, its whole body). `Err`: the answer cannot make a decode leg.
pub(crate) fn decode_leg(
    protocol: DisaggregationProtocol,
    request: Map<String, Value>,
    answer: &[u8],
) -> Result<Bytes, String> {
    match protocol {
        DisaggregationProtocol::Vllm => vllm::decode_leg(request, answer),
    }
}

//! Building `ModelInferResponse`s from what the engine generated.

use std::collections::HashMap;

use kvmesh_proto::inference::infer_parameter::ParameterChoice;
use kvmesh_proto::inference::model_infer_response::InferOutputTensor;
use kvmesh_proto::inference::{InferParameter, ModelInferRequest, ModelInferResponse};
use kvmesh_wire::engine_json::Piece;
use kvmesh_wire::kserve::invalid::InvalidInput;

use crate::frontend::grpc::catalog::{
    COMPLETION_TOKENS, FINAL_RESPONSE, FINISH_REASON, MODEL_VERSION, PROMPT_TOKENS, TEXT_OUTPUT,
};

/// How responses to one request look: what they echo and which outputs they hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    /// The request's `model_name`, as given.
    model_name: String,
    /// The request's `id`.
    id: String,
    /// Send `text_output`.
    text_output: bool,
    /// Send `finish_reason`.
    finish_reason: bool,
}

impl Reply {
    /// The replies to `request`: every output, or the ones it asks for.
    pub(crate) fn to(request: &ModelInferRequest) -> Result<Self, InvalidInput> {
        let mut reply = Self {
            model_name: request.model_name.clone(),
            id: request.id.clone(),
            text_output: request.outputs.is_empty(),
            finish_reason: request.outputs.is_empty(),
        };
        for output in &request.outputs {
            match output.name.as_str() {
                TEXT_OUTPUT => reply.text_output = true,
                FINISH_REASON => reply.finish_reason = true,
                other => {
                    return Err(InvalidInput::new(format!(
                        "unknown output {other:?}; outputs: {TEXT_OUTPUT}, {FINISH_REASON}"
                    )));
                }
            }
        }
        Ok(reply)
    }

    /// A response without outputs.
    fn bare(&self) -> ModelInferResponse {
        ModelInferResponse {
            model_name: self.model_name.clone(),
            model_version: MODEL_VERSION.to_string(),
            id: self.id.clone(),
            ..Default::default()
        }
    }

    /// The response carrying `piece`; `last` marks the request's final response.
    pub(crate) fn response(&self, piece: Piece, last: bool) -> ModelInferResponse {
        let mut response = self.bare();
        if self.text_output {
            push_bytes(&mut response, TEXT_OUTPUT, piece.text.as_bytes());
        }
        if self.finish_reason {
            let reason = piece.finish_reason.unwrap_or_default();
            push_bytes(&mut response, FINISH_REASON, reason.as_bytes());
        }
        if let Some(usage) = piece.usage {
            response.parameters = HashMap::from([
                (PROMPT_TOKENS.to_string(), int(usage.prompt_tokens)),
                (COMPLETION_TOKENS.to_string(), int(usage.completion_tokens)),
            ]);
        }
        if last {
            response.parameters.insert(
                FINAL_RESPONSE.to_string(),
                InferParameter {
                    parameter_choice: Some(ParameterChoice::BoolParam(true)),
                },
            );
        }
        response
    }
}

/// Adds the BYTES output `name` holding `value`, as Triton sends it: in
/// `raw_output_contents`, a 4-byte little-endian length and the bytes (clients read this
/// form everywhere; some mishandle typed `bytes_contents`).
fn push_bytes(response: &mut ModelInferResponse, name: &str, value: &[u8]) {
    response.outputs.push(InferOutputTensor {
        name: name.to_string(),
        datatype: "BYTES".to_string(),
        shape: vec![1],
        parameters: HashMap::new(),
        contents: None,
    });
    let length = u32::try_from(value.len()).unwrap_or(u32::MAX);
    let mut raw = Vec::with_capacity(4 + value.len());
    raw.extend_from_slice(&length.to_le_bytes());
    raw.extend_from_slice(value);
    response.raw_output_contents.push(raw);
}

fn int(value: u64) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::Int64Param(
            i64::try_from(value).unwrap_or(i64::MAX),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_proto::inference::model_infer_request::InferRequestedOutputTensor;
    use kvmesh_wire::engine_json::Usage;

    fn request(outputs: &[&str]) -> ModelInferRequest {
        ModelInferRequest {
            model_name: "alias".into(),
            id: "r1".into(),
            outputs: outputs
                .iter()
                .map(|name| InferRequestedOutputTensor {
                    name: name.to_string(),
                    parameters: HashMap::new(),
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn every_output_unless_some_are_asked_for() {
        let piece = Piece {
            text: "hi".into(),
            finish_reason: Some("length".into()),
            usage: Some(Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
            }),
        };
        let all = Reply::to(&request(&[]))
            .unwrap()
            .response(piece.clone(), true);
        assert_eq!(
            (
                all.model_name.as_str(),
                all.model_version.as_str(),
                all.id.as_str()
            ),
            ("alias", "1", "r1")
        );
        let names: Vec<_> = all.outputs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, [TEXT_OUTPUT, FINISH_REASON]);
        assert_eq!(all.outputs[0].shape, [1]);
        assert_eq!(all.raw_output_contents[1], b"\x06\0\0\0length");
        assert_eq!(all.raw_output_contents[0], b"\x02\0\0\0hi");
        assert_eq!(
            all.parameters[PROMPT_TOKENS].parameter_choice,
            Some(ParameterChoice::Int64Param(3))
        );
        assert_eq!(
            all.parameters[FINAL_RESPONSE].parameter_choice,
            Some(ParameterChoice::BoolParam(true))
        );
        let text_only = Reply::to(&request(&[TEXT_OUTPUT]))
            .unwrap()
            .response(Piece::default(), false);
        assert_eq!(text_only.outputs.len(), 1);
        assert!(text_only.parameters.is_empty());
        assert!(
            Reply::to(&request(&["logits"]))
                .unwrap_err()
                .0
                .contains("unknown output \"logits\"")
        );
    }
}

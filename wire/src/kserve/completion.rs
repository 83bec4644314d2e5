//! A KServe inference request → the OpenAI `/v1/completions` request the engines serve:
//! `prompt` from `text_input` (or `input_ids`), `stream` from `streaming`, sampling
//! fields from the parameters.

use bytes::Bytes;
use kvmesh_proto::inference::ModelInferRequest;
use serde_json::{Map, Value, json};

use crate::kserve::invalid::InvalidInput;
use crate::kserve::params::{apply_parameters, apply_sampling_json};
use crate::kserve::tensors::{PromptInput, read_inputs};

/// The engine request of one inference request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The `/v1/completions` JSON body.
    pub body: Bytes,
    /// The engine is asked to stream (`streaming` was set).
    pub stream: bool,
}

/// The completion request for `request`, addressed to `model` (the canonical name).
pub fn completion(request: &ModelInferRequest, model: &str) -> Result<Completion, InvalidInput> {
    let inputs = read_inputs(request)?;
    let mut body = Map::new();
    if let Some(json) = &inputs.sampling_parameters {
        apply_sampling_json(json, &mut body)?;
    }
    apply_parameters(&request.parameters, &mut body)?;
    body.insert("model".to_string(), Value::from(model));
    let prompt = match inputs.prompt {
        PromptInput::Text(text) => Value::from(text),
        PromptInput::Tokens(ids) => Value::from(ids),
    };
    body.insert("prompt".to_string(), prompt);
    body.insert("stream".to_string(), Value::from(inputs.streaming));
    if inputs.streaming {
        // Token counts arrive in a last usage chunk.
        body.insert("stream_options".to_string(), json!({"include_usage": true}));
    }
    let body = serde_json::to_vec(&Value::Object(body))
        .map_err(|error| InvalidInput::new(format!("the request cannot be encoded: {error}")))?;
    Ok(Completion {
        body: Bytes::from(body),
        stream: inputs.streaming,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use kvmesh_proto::inference::infer_parameter::ParameterChoice;
    use kvmesh_proto::inference::model_infer_request::InferInputTensor;
    use kvmesh_proto::inference::{InferParameter, InferTensorContents};

    fn bytes_input(name: &str, value: &str) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: "BYTES".into(),
            shape: vec![1],
            parameters: HashMap::new(),
            contents: Some(InferTensorContents {
                bytes_contents: vec![value.as_bytes().to_vec()],
                ..Default::default()
            }),
        }
    }

    fn body(completion: &Completion) -> Value {
        serde_json::from_slice(&completion.body).unwrap()
    }

    #[test]
    fn text_prompt_with_parameters() {
        let request = ModelInferRequest {
            model_name: "alias".into(),
            inputs: vec![
                bytes_input("text_input", "Hello"),
                bytes_input("sampling_parameters", r#"{"max_tokens": 99, "top_p": 0.9}"#),
            ],
            parameters: HashMap::from([(
                "max_tokens".to_string(),
                InferParameter {
                    parameter_choice: Some(ParameterChoice::Int64Param(5)),
                },
            )]),
            ..Default::default()
        };
        let completion = completion(&request, "canonical").unwrap();
        assert!(!completion.stream);
        assert_eq!(
            body(&completion),
            json!({"model": "canonical", "prompt": "Hello", "stream": false, "max_tokens": 5, "top_p": 0.9})
        );
    }

    #[test]
    fn streamed_token_prompt_asks_for_usage() {
        let request = ModelInferRequest {
            inputs: vec![
                InferInputTensor {
                    name: "input_ids".into(),
                    datatype: "INT64".into(),
                    shape: vec![1, 3],
                    parameters: HashMap::new(),
                    contents: Some(InferTensorContents {
                        int64_contents: vec![1, 2, 3],
                        ..Default::default()
                    }),
                },
                InferInputTensor {
                    name: "streaming".into(),
                    datatype: "BOOL".into(),
                    shape: vec![1],
                    parameters: HashMap::new(),
                    contents: Some(InferTensorContents {
                        bool_contents: vec![true],
                        ..Default::default()
                    }),
                },
            ],
            ..Default::default()
        };
        let completion = completion(&request, "m").unwrap();
        assert!(completion.stream);
        assert_eq!(
            body(&completion),
            json!({"model": "m", "prompt": [1, 2, 3], "stream": true, "stream_options": {"include_usage": true}})
        );
    }
}

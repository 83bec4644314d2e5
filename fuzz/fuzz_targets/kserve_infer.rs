//! A KServe v2 `ModelInferRequest` as the gRPC listener reads it (`kvmesh_wire::kserve`): the
//! protobuf message (prost), its input tensors (`read_inputs`: typed `contents` or
//! `raw_input_contents`), its parameters, and the OpenAI completion request it becomes
//! (`completion`).
//!
//! Input: the encoded message. Whatever it holds: nothing panics; a request that becomes a
//! completion has inputs that read, and the completion's JSON body names the model, the
//! prompt and `stream` as its inputs say, holds only accepted parameter names, and carries
//! each typed request parameter as given; and a request whose typed tensors read reads the
//! same with the same tensors sent as `raw_input_contents` (little-endian numbers,
//! length-prefixed BYTES).

#![no_main]

use kvmesh_proto::inference::ModelInferRequest;
use kvmesh_proto::inference::infer_parameter::ParameterChoice;
use kvmesh_proto::inference::model_infer_request::InferInputTensor;
use kvmesh_wire::kserve::completion::completion;
use kvmesh_wire::kserve::params::PARAMETER_NAMES;
use kvmesh_wire::kserve::tensors::{PromptInput, read_inputs};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use serde_json::Value;

/// The typed contents of `input` as `raw_input_contents` holds them.
fn raw(input: &InferInputTensor) -> Vec<u8> {
    let contents = input.contents.clone().unwrap_or_default();
    match input.datatype.as_str() {
        "BYTES" => contents
            .bytes_contents
            .iter()
            .flat_map(|element| {
                let length = u32::try_from(element.len()).expect("fuzz inputs are short");
                length
                    .to_le_bytes()
                    .into_iter()
                    .chain(element.iter().copied())
            })
            .collect(),
        "BOOL" => contents
            .bool_contents
            .iter()
            .map(|&b| u8::from(b))
            .collect(),
        "INT32" => contents
            .int_contents
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        "INT64" => contents
            .int64_contents
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        "UINT32" => contents
            .uint_contents
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        _ => contents
            .uint64_contents
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
    }
}

/// Request parameters read as no sampling field (Triton's and KServe's own).
fn ignored(name: &str) -> bool {
    matches!(
        name,
        "sequence_id" | "sequence_start" | "sequence_end" | "priority" | "timeout"
    ) || name.starts_with("triton_")
}

fuzz_target!(|data: &[u8]| {
    let Ok(request) = ModelInferRequest::decode(data) else {
        return;
    };
    let inputs = read_inputs(&request);
    if let Ok(read) = &inputs
        && request.raw_input_contents.is_empty()
    {
        let as_raw = ModelInferRequest {
            inputs: request
                .inputs
                .iter()
                .map(|input| InferInputTensor {
                    contents: None,
                    ..input.clone()
                })
                .collect(),
            raw_input_contents: request.inputs.iter().map(raw).collect(),
            ..request.clone()
        };
        assert_eq!(read_inputs(&as_raw).as_ref(), Ok(read), "sent raw");
    }
    let Ok(completion) = completion(&request, "m") else {
        return;
    };
    let inputs = inputs.expect("a request that becomes a completion has inputs that read");
    assert_eq!(completion.stream, inputs.streaming);
    let body: Value = serde_json::from_slice(&completion.body).expect("the body is JSON");
    let body = body.as_object().expect("the body is an object");
    assert_eq!(body["model"], "m");
    assert_eq!(body["stream"], inputs.streaming);
    assert_eq!(body.contains_key("stream_options"), inputs.streaming);
    match inputs.prompt {
        PromptInput::Text(text) => assert_eq!(body["prompt"], text),
        PromptInput::Tokens(ids) => assert_eq!(body["prompt"], Value::from(ids)),
    }
    for name in body.keys() {
        assert!(
            PARAMETER_NAMES.contains(&name.as_str())
                || ["model", "prompt", "stream", "stream_options"].contains(&name.as_str()),
            "{name:?}"
        );
    }
    for (name, parameter) in &request.parameters {
        if ignored(name) {
            continue;
        }
        let carried = &body[name.as_str()];
        let given = match parameter.parameter_choice.as_ref() {
            Some(ParameterChoice::BoolParam(b)) => Value::from(*b),
            Some(ParameterChoice::Int64Param(n)) => Value::from(*n),
            Some(ParameterChoice::Uint64Param(n)) => Value::from(*n),
            Some(ParameterChoice::DoubleParam(x)) => {
                // Compared as written: serde_json reads a float back only to within a few
                // ulps (without its `float_roundtrip`), the engine reads the exact value.
                let field = format!("{}:{}", Value::from(name.as_str()), Value::from(*x));
                let written = String::from_utf8_lossy(&completion.body);
                assert!(
                    carried.is_number() && written.contains(&field),
                    "{field} in {written}"
                );
                continue;
            }
            Some(ParameterChoice::StringParam(s)) => Value::from(s.as_str()),
            None => Value::Null,
        };
        assert_eq!(carried, &given, "parameter {name:?}");
    }
});

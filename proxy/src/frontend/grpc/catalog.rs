//! How the gRPC listener describes itself and its models: every served model is a
//! text-generation model with the same inputs and outputs (answered from here by
//! ServerMetadata, ModelMetadata and ModelConfig, and checked by the request
//! translation).

use std::collections::HashMap;

use kvmesh_proto::inference::model_metadata_response::TensorMetadata;
use kvmesh_proto::inference::{
    DataType, ModelConfig, ModelInput, ModelMetadataResponse, ModelOutput, ModelParameter,
    ModelTransactionPolicy, ServerMetadataResponse,
};
use kvmesh_wire::kserve::params::PARAMETER_NAMES;
use kvmesh_wire::kserve::tensors::{INPUT_IDS, SAMPLING_PARAMETERS, STREAMING, TEXT_INPUT};

/// The server name in ServerMetadata.
const SERVER_NAME: &str = "kvmesh";
/// The platform and backend every model reports.
pub(crate) const PLATFORM: &str = "kvmesh";
/// The one version of every model.
pub(crate) const MODEL_VERSION: &str = "1";

/// Output: the generated text (a delta per response when streaming).
pub(crate) const TEXT_OUTPUT: &str = "text_output";
/// Output: why generation stopped (`stop`, `length`, ...; empty until it has).
pub(crate) const FINISH_REASON: &str = "finish_reason";

/// Response parameter: prompt tokens (once known, on the last response).
pub(crate) const PROMPT_TOKENS: &str = "prompt_tokens";
/// Response parameter: generated tokens (once known, on the last response).
pub(crate) const COMPLETION_TOKENS: &str = "completion_tokens";
/// Response parameter: `true` on the last response to a request.
pub(crate) const FINAL_RESPONSE: &str = "triton_final_response";

/// One tensor of the model description.
struct Tensor {
    name: &'static str,
    datatype: &'static str,
    data_type: DataType,
    dims: &'static [i64],
    optional: bool,
}

/// The inputs every model accepts: exactly one of `text_input` and `input_ids`; the rest
/// optional. (`input_ids` also accepts INT32; `stream` is accepted for `streaming`.)
const INPUTS: [Tensor; 4] = [
    Tensor {
        name: TEXT_INPUT,
        datatype: "BYTES",
        data_type: DataType::TypeString,
        dims: &[1],
        optional: true,
    },
    Tensor {
        name: INPUT_IDS,
        datatype: "INT64",
        data_type: DataType::TypeInt64,
        dims: &[-1],
        optional: true,
    },
    Tensor {
        name: STREAMING,
        datatype: "BOOL",
        data_type: DataType::TypeBool,
        dims: &[1],
        optional: true,
    },
    Tensor {
        name: SAMPLING_PARAMETERS,
        datatype: "BYTES",
        data_type: DataType::TypeString,
        dims: &[1],
        optional: true,
    },
];

/// The outputs of every response.
const OUTPUTS: [Tensor; 2] = [
    Tensor {
        name: TEXT_OUTPUT,
        datatype: "BYTES",
        data_type: DataType::TypeString,
        dims: &[1],
        optional: false,
    },
    Tensor {
        name: FINISH_REASON,
        datatype: "BYTES",
        data_type: DataType::TypeString,
        dims: &[1],
        optional: false,
    },
];

/// Whether `version` names the one version of every model (empty: the server's choice).
pub(crate) fn is_served_version(version: &str) -> bool {
    version.is_empty() || version == MODEL_VERSION
}

/// ServerMetadata: name, version and the protocol extensions served.
pub(crate) fn server_metadata() -> ServerMetadataResponse {
    ServerMetadataResponse {
        name: SERVER_NAME.to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        extensions: vec!["model_configuration".to_string()],
    }
}

/// ModelMetadata of the model `name`.
pub(crate) fn model_metadata(name: &str) -> ModelMetadataResponse {
    let metadata = |tensor: &Tensor| TensorMetadata {
        name: tensor.name.to_string(),
        datatype: tensor.datatype.to_string(),
        shape: tensor.dims.to_vec(),
    };
    ModelMetadataResponse {
        name: name.to_string(),
        versions: vec![MODEL_VERSION.to_string()],
        platform: PLATFORM.to_string(),
        inputs: INPUTS.iter().map(metadata).collect(),
        outputs: OUTPUTS.iter().map(metadata).collect(),
    }
}

/// ModelConfig of the model `name`: decoupled (a streamed request gets many responses),
/// no batch dimension, and the request parameters it accepts.
pub(crate) fn model_config(name: &str) -> ModelConfig {
    let parameters = HashMap::from([
        (
            "openai_endpoint".to_string(),
            ModelParameter {
                string_value: "/v1/completions".to_string(),
            },
        ),
        (
            "request_parameters".to_string(),
            ModelParameter {
                string_value: PARAMETER_NAMES.join(","),
            },
        ),
    ]);
    ModelConfig {
        name: name.to_string(),
        platform: PLATFORM.to_string(),
        backend: PLATFORM.to_string(),
        max_batch_size: 0,
        input: INPUTS
            .iter()
            .map(|tensor| ModelInput {
                name: tensor.name.to_string(),
                data_type: tensor.data_type as i32,
                dims: tensor.dims.to_vec(),
                optional: tensor.optional,
            })
            .collect(),
        output: OUTPUTS
            .iter()
            .map(|tensor| ModelOutput {
                name: tensor.name.to_string(),
                data_type: tensor.data_type as i32,
                dims: tensor.dims.to_vec(),
            })
            .collect(),
        parameters,
        model_transaction_policy: Some(ModelTransactionPolicy { decoupled: true }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_and_config_describe_the_same_tensors() {
        let metadata = model_metadata("m");
        let config = model_config("m");
        assert_eq!(metadata.name, "m");
        assert_eq!(metadata.versions, ["1"]);
        let names: Vec<_> = metadata.inputs.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [TEXT_INPUT, INPUT_IDS, STREAMING, SAMPLING_PARAMETERS]
        );
        let config_names: Vec<_> = config.input.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, config_names);
        let outputs: Vec<_> = config.output.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(outputs, [TEXT_OUTPUT, FINISH_REASON]);
        assert_eq!(metadata.outputs[0].datatype, "BYTES");
        assert_eq!(config.output[0].data_type, DataType::TypeString as i32);
        assert!(config.model_transaction_policy.unwrap().decoupled);
        assert!(
            config.parameters["request_parameters"]
                .string_value
                .contains("max_tokens")
        );
    }

    #[test]
    fn only_version_one_is_served() {
        assert!(is_served_version(""));
        assert!(is_served_version("1"));
        assert!(!is_served_version("2"));
    }
}

//! Sampling parameters → OpenAI completion fields. They come as request `parameters`
//! (typed) or as the `sampling_parameters` input (a JSON object whose values may also be
//! strings, as Triton's vLLM backend accepts); request parameters win.

use std::collections::HashMap;

use kvmesh_proto::inference::InferParameter;
use kvmesh_proto::inference::infer_parameter::ParameterChoice;
use serde_json::{Map, Value};

use crate::kserve::invalid::InvalidInput;

/// The value a parameter takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// An integer.
    Integer,
    /// A finite number.
    Number,
    /// A boolean.
    Bool,
    /// A stop string (in JSON: one string or a list of strings).
    Stop,
    /// One string.
    Text,
}

/// Every accepted parameter, as named in the OpenAI completion request.
const PARAMETERS: [(&str, Kind); 13] = [
    ("max_tokens", Kind::Integer),
    ("min_tokens", Kind::Integer),
    ("temperature", Kind::Number),
    ("top_p", Kind::Number),
    ("top_k", Kind::Integer),
    ("min_p", Kind::Number),
    ("seed", Kind::Integer),
    ("frequency_penalty", Kind::Number),
    ("presence_penalty", Kind::Number),
    ("repetition_penalty", Kind::Number),
    ("ignore_eos", Kind::Bool),
    ("stop", Kind::Stop),
    // vLLM's per-request prefix-cache namespace; the proxy salts the prompt's block hashes
    // with it as the engine salts its cache.
    ("cache_salt", Kind::Text),
];

/// The accepted parameter names, for messages and ModelConfig.
pub const PARAMETER_NAMES: [&str; 13] = {
    let mut names = [""; 13];
    let mut i = 0;
    while i < PARAMETERS.len() {
        names[i] = PARAMETERS[i].0;
        i += 1;
    }
    names
};

/// Triton and KServe request parameters without a sampling meaning (sequence batching,
/// priority, Triton's own switches): accepted and ignored.
fn is_ignored(name: &str) -> bool {
    matches!(
        name,
        "sequence_id" | "sequence_start" | "sequence_end" | "priority" | "timeout"
    ) || name.starts_with("triton_")
}

fn kind(name: &str) -> Result<Kind, InvalidInput> {
    PARAMETERS
        .iter()
        .find(|(known, _)| *known == name)
        .map(|(_, kind)| *kind)
        .ok_or_else(|| {
            InvalidInput::new(format!(
                "unknown parameter {name:?}; supported: {}",
                PARAMETER_NAMES.join(", ")
            ))
        })
}

/// Copies the request `parameters` into `body`.
pub(crate) fn apply_parameters(
    parameters: &HashMap<String, InferParameter>,
    body: &mut Map<String, Value>,
) -> Result<(), InvalidInput> {
    for (name, parameter) in parameters {
        if is_ignored(name) {
            continue;
        }
        let kind = kind(name)?;
        let value = typed_value(kind, parameter.parameter_choice.as_ref())
            .ok_or_else(|| wrong_type(name, kind))?;
        body.insert(name.clone(), value);
    }
    Ok(())
}

/// Copies the fields of the `sampling_parameters` JSON object into `body`.
pub(crate) fn apply_sampling_json(
    json: &str,
    body: &mut Map<String, Value>,
) -> Result<(), InvalidInput> {
    let object: Map<String, Value> = serde_json::from_str(json).map_err(|error| {
        InvalidInput::new(format!(
            "input \"sampling_parameters\" is not a JSON object: {error}"
        ))
    })?;
    for (name, value) in object {
        let kind = kind(&name)?;
        let value = json_value(kind, value).ok_or_else(|| wrong_type(&name, kind))?;
        body.insert(name, value);
    }
    Ok(())
}

fn wrong_type(name: &str, kind: Kind) -> InvalidInput {
    let expected = match kind {
        Kind::Integer => "an integer",
        Kind::Number => "a finite number",
        Kind::Bool => "a boolean",
        Kind::Stop | Kind::Text => "a string",
    };
    InvalidInput::new(format!("parameter {name:?} must be {expected}"))
}

/// A typed request parameter as JSON, if it has the right type.
fn typed_value(kind: Kind, choice: Option<&ParameterChoice>) -> Option<Value> {
    match (kind, choice?) {
        (Kind::Integer | Kind::Number, ParameterChoice::Int64Param(n)) => Some(Value::from(*n)),
        (Kind::Integer | Kind::Number, ParameterChoice::Uint64Param(n)) => Some(Value::from(*n)),
        (Kind::Number, ParameterChoice::DoubleParam(x)) => finite(*x),
        (Kind::Bool, ParameterChoice::BoolParam(b)) => Some(Value::from(*b)),
        (Kind::Stop | Kind::Text, ParameterChoice::StringParam(s)) => Some(Value::from(s.as_str())),
        _ => None,
    }
}

/// A `sampling_parameters` value as the engine expects it, if it has (or, as a string,
/// spells) the right type.
fn json_value(kind: Kind, value: Value) -> Option<Value> {
    match (kind, value) {
        (Kind::Integer, Value::Number(n)) if n.is_i64() || n.is_u64() => Some(Value::Number(n)),
        (Kind::Integer, Value::String(s)) => s.trim().parse::<i64>().ok().map(Value::from),
        (Kind::Number, Value::Number(n)) => n.as_f64().and_then(finite),
        (Kind::Number, Value::String(s)) => s.trim().parse::<f64>().ok().and_then(finite),
        (Kind::Bool, Value::Bool(b)) => Some(Value::Bool(b)),
        (Kind::Bool, Value::String(s)) => match s.trim() {
            "true" | "True" => Some(Value::Bool(true)),
            "false" | "False" => Some(Value::Bool(false)),
            _ => None,
        },
        (Kind::Stop | Kind::Text, Value::String(s)) => Some(Value::String(s)),
        (Kind::Stop, Value::Array(items)) if items.iter().all(Value::is_string) => {
            Some(Value::Array(items))
        }
        _ => None,
    }
}

fn finite(x: f64) -> Option<Value> {
    x.is_finite()
        .then(|| serde_json::Number::from_f64(x).map(Value::Number))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(choice: ParameterChoice) -> InferParameter {
        InferParameter {
            parameter_choice: Some(choice),
        }
    }

    fn apply(parameters: &[(&str, ParameterChoice)]) -> Result<Value, InvalidInput> {
        let parameters = parameters
            .iter()
            .map(|(name, choice)| (name.to_string(), param(choice.clone())))
            .collect();
        let mut body = Map::new();
        apply_parameters(&parameters, &mut body)?;
        Ok(Value::Object(body))
    }

    #[test]
    fn typed_parameters_become_openai_fields() {
        let body = apply(&[
            ("max_tokens", ParameterChoice::Int64Param(12)),
            ("temperature", ParameterChoice::DoubleParam(0.5)),
            ("top_p", ParameterChoice::Int64Param(1)),
            ("seed", ParameterChoice::Uint64Param(7)),
            ("ignore_eos", ParameterChoice::BoolParam(true)),
            ("stop", ParameterChoice::StringParam("\n\n".into())),
            (
                "cache_salt",
                ParameterChoice::StringParam("tenant-a".into()),
            ),
            ("sequence_id", ParameterChoice::Int64Param(3)),
            (
                "triton_enable_empty_final_response",
                ParameterChoice::BoolParam(true),
            ),
        ])
        .unwrap();
        assert_eq!(
            body,
            json!({"max_tokens": 12, "temperature": 0.5, "top_p": 1, "seed": 7,
                   "ignore_eos": true, "stop": "\n\n", "cache_salt": "tenant-a"})
        );
    }

    #[test]
    fn wrong_types_and_unknown_names_are_rejected() {
        let error = apply(&[("max_tokens", ParameterChoice::DoubleParam(1.5))]).unwrap_err();
        assert_eq!(error.0, "parameter \"max_tokens\" must be an integer");
        let error =
            apply(&[("temperature", ParameterChoice::StringParam("hot".into()))]).unwrap_err();
        assert!(error.0.contains("finite number"), "{error:?}");
        let error = apply(&[("temperature", ParameterChoice::DoubleParam(f64::NAN))]).unwrap_err();
        assert!(error.0.contains("finite number"), "{error:?}");
        let error = apply(&[("max_token", ParameterChoice::Int64Param(1))]).unwrap_err();
        assert!(
            error
                .0
                .starts_with("unknown parameter \"max_token\"; supported: max_tokens")
        );
        let error = apply(&[("cache_salt", ParameterChoice::Int64Param(1))]).unwrap_err();
        assert_eq!(error.0, "parameter \"cache_salt\" must be a string");
        let mut body = Map::new();
        let no_value = HashMap::from([("seed".to_string(), InferParameter::default())]);
        assert!(apply_parameters(&no_value, &mut body).is_err());
    }

    #[test]
    fn sampling_json_accepts_spelled_out_values() {
        let mut body = Map::new();
        apply_sampling_json(
            r#"{"max_tokens": "8", "temperature": "0.1", "ignore_eos": "false", "stop": ["a", "b"], "top_k": 5}"#,
            &mut body,
        )
        .unwrap();
        assert_eq!(
            Value::Object(body),
            json!({"max_tokens": 8, "temperature": 0.1, "ignore_eos": false, "stop": ["a", "b"], "top_k": 5})
        );
        let mut body = Map::new();
        for bad in [
            r#"[1]"#,
            r#"{"max_tokens": 1.5}"#,
            r#"{"stop": [1]}"#,
            r#"{"cache_salt": ["a"]}"#,
            r#"{"beam": 2}"#,
        ] {
            assert!(apply_sampling_json(bad, &mut body).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_are_listed_in_order() {
        assert_eq!(PARAMETER_NAMES[0], "max_tokens");
        assert_eq!(PARAMETER_NAMES[11], "stop");
        assert_eq!(PARAMETER_NAMES[12], "cache_salt");
    }
}
